"""A row-parallel linear whose GEMMs see its input width padded to 16 bytes.

cuBLAS runs its Hopper GEMMs only on operands whose rows start 16 bytes apart; a reduction width
that is not a multiple of 8 bf16 elements (Qwen2.5-VL's vision MLP: 3,420) sends all three GEMMs
of the layer (forward, input grad, weight grad) to sm_80 kernels at about a third of the rate.
Here the input and the weight get zero columns up to the next multiple for the GEMM only: the
product is the same (the padded columns add zeros), the weight's grad is the padded one's first
columns, and the parameter keeps its shape, so checkpoints, the HF mapping and LoRA are untouched.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.tensor_parallel import RowParallelLinear

ROW_ALIGN_BYTES = 16


def padded_width(width: int, element_size: int) -> int:
    """``width`` rounded up so that a row of ``element_size``-byte elements spans a multiple of 16 bytes."""
    per_row = max(1, ROW_ALIGN_BYTES // element_size)
    return -(-width // per_row) * per_row


class AlignedRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` that pads its input width (its rank's share) for the GEMMs with zero
    columns to a multiple of 16 bytes; the same numbers, on cuBLAS' aligned kernels. With
    megatron's gradient-accumulation fusion (which writes the weight's grad into the parameter's
    ``main_grad`` itself) it computes unpadded."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        pad = padded_width(weight.shape[-1], weight.element_size()) - weight.shape[-1]
        if pad and not self.gradient_accumulation_fusion:
            input, weight = F.pad(input, (0, pad)), F.pad(weight, (0, pad))
        return super()._forward_impl(input, weight, *args, **kwargs)



