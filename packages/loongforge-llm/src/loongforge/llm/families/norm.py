"""RMSNorm and LayerNorm for the MoE families' layer specs on megatron-core's local backend.

megatron's local norm (``WrappedTorchNorm``, used when Apex is absent) refuses sequence
parallelism: under SP each TP rank normalises only its part of the sequence, so the weight's
gradient must be summed over TP, and finalize_model_grads does that only for weights marked
``sequence_parallel``, which that wrapper does not mark. megatron's MoE layer in turn refuses
to train under TP without SP. These norms are torch's, built like megatron's norms
(``config, hidden_size, eps``) with their parameters marked, so MoE models train under TP
anywhere. The LayerNorm is DeepSeek-V3.2's indexer key norm (megatron builds it with a
config whose ``normalization`` is LayerNorm).
"""

from __future__ import annotations

import torch


def _check_normalization(norm: torch.nn.Module, config, expected: str) -> None:
    if config.normalization != expected:
        raise ValueError(f"{type(norm).__name__} is a {expected}; the config asks for {config.normalization}")


def _mark_sequence_parallel(norm: torch.nn.Module, config) -> None:
    for param in norm.parameters():
        setattr(param, "sequence_parallel", config.sequence_parallel)


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        _check_normalization(self, config, "RMSNorm")
        super().__init__(hidden_size, eps=eps)
        _mark_sequence_parallel(self, config)


class LayerNorm(torch.nn.LayerNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        _check_normalization(self, config, "LayerNorm")
        super().__init__(hidden_size, eps=eps)
        _mark_sequence_parallel(self, config)
