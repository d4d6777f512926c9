"""What a modality hands the shared megatron trainer: the model, the batches and the loss.

Per step, ``micro_batches`` yields either a plain list of micro-batches (exactly
``global_batch_size / (micro_batch_size * dp)`` of them) or a ``StepBatch``, whose number of
micro-batches may differ from step to step and from DP rank to DP rank (a task that plans its
own micro-batches, e.g. with the DP load balancer, sets ``variable_micro_batches = True``). Every
rank of one DP replica (its TP, PP and CP ranks) must get the same micro-batches.

The iterator ``micro_batches`` returns may also keep state for checkpoints (``state_dict()`` /
``load_state_dict(state)``, saved per rank) and take measurements (``measuring``,
``record_compute_seconds(seconds)``), as ``loongforge.core.training.balanced.BalancedSteps``
does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class StepBatch:
    """One step of one DP rank."""

    micro_batches: list[dict[str, torch.Tensor]]
    tokens: int | None = None  # input tokens of this DP replica's micro-batches (throughput); None: G * seq_length
    metrics: dict[str, float] = field(default_factory=dict)  # logged with the step (the same on every rank)
    sample_ids: list[int] = field(default_factory=list)  # dataset indices trained by this DP replica


class MegatronTask(Protocol):
    family: str  # registry name of the model family (recorded in checkpoints)
    variable_micro_batches: bool = False  # True: steps are StepBatch with any number of micro-batches

    def model_config_dict(self) -> dict:
        """The full model config, recorded in checkpoint manifests and checked on load."""

    def build_model(self, ctx, transformer_config, pre_process: bool, post_process: bool,
                    load_initial_weights: bool = True) -> torch.nn.Module:
        """This rank's model chunk. ``load_initial_weights`` is False when the trainer resumes from
        a checkpoint of the run, which holds every weight: pretrained weights the task would read
        (a Hugging Face model, a LoRA base) are not read again."""

    def transformer_config_kwargs(self) -> dict:
        """Architecture fields of megatron's TransformerConfig."""

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs (forward + backward) per token, for MFU."""

    def micro_batches(self, ctx, consumed_samples: int) -> Iterator[list[dict[str, torch.Tensor]] | StepBatch]:
        """Per step, this rank's micro-batches, starting after ``consumed_samples`` global samples."""

    def forward_step(self, data_iterator, model) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        """megatron-core forward step (reads one micro-batch from ``data_iterator``): returns ``(output, loss_func)``; ``loss_func(output)`` returns
        ``(loss_sum, num_tokens, {"lm loss": (loss_sum, num_tokens)})``."""
