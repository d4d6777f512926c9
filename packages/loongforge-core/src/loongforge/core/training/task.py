"""What a modality hands the shared megatron trainer: the model, the batches and the loss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class MegatronTask(Protocol):
    family: str  # registry name of the model family (recorded in checkpoints)

    def model_config_dict(self) -> dict:
        """The full model config, recorded in checkpoint manifests and checked on load."""

    def build_model(self, ctx, transformer_config, pre_process: bool, post_process: bool) -> torch.nn.Module:
        """This rank's model chunk."""

    def transformer_config_kwargs(self) -> dict:
        """Architecture fields of megatron's TransformerConfig."""

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs (forward + backward) per token, for MFU."""

    def micro_batches(self, ctx, consumed_samples: int) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Per step, this rank's micro-batches, starting after ``consumed_samples`` global samples."""

    def forward_step(self, data_iterator, model) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        """megatron-core forward step (reads one micro-batch from ``data_iterator``): returns ``(output, loss_func)``; ``loss_func(output)`` returns
        ``(loss_sum, num_tokens, {"lm loss": (loss_sum, num_tokens)})``."""
