"""RMSNorm for the MoE families' layer specs on megatron-core's local backend.

megatron's local norm (``WrappedTorchNorm``, used when Apex is absent) refuses sequence
parallelism: under SP each TP rank normalises only its part of the sequence, so the weight's
gradient must be summed over TP, and finalize_model_grads does that only for weights marked
``sequence_parallel``, which that wrapper does not mark. megatron's MoE layer in turn refuses
to train under TP without SP. This norm is torch's RMSNorm built like megatron's norms
(``config, hidden_size, eps``) with its weight marked, so MoE models train under TP anywhere.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_options):
        if config.normalization != "RMSNorm":
            raise ValueError(f"{type(self).__name__} is an RMSNorm; the config asks for {config.normalization}")
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
