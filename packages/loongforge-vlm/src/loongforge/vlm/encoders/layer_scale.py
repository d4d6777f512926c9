"""Layer scale (CaiT's, InternViT's ``lambda_1``/``lambda_2``): a learned per-channel factor on a
residual branch's output before it is added back. Here it is the output linear of the branch
(attention's ``linear_proj``, the MLP's ``linear_fc2``) that scales what it returns, its bias
included, so megatron's bias-dropout-add and layer stay as they are.

The factor is ``[hidden]`` and replicated on every TP rank (the row-parallel output is already
reduced, so every rank scales the full width)."""

from __future__ import annotations

import torch

from loongforge.vlm.encoders.aligned_linear import AlignedRowParallelLinear


class LayerScaledRowParallelLinear(AlignedRowParallelLinear):
    """``AlignedRowParallelLinear`` whose output (and separately returned bias) is multiplied by
    ``layer_scale [output_size]``, initialised to ``layer_scale_init``."""

    def __init__(self, input_size: int, output_size: int, *args, layer_scale_init: float = 1.0, **kwargs):
        super().__init__(input_size, output_size, *args, **kwargs)
        dtype = kwargs["config"].params_dtype
        self.layer_scale = torch.nn.Parameter(torch.full((output_size,), float(layer_scale_init), dtype=dtype))

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output * self.layer_scale, (bias * self.layer_scale if bias is not None else None)
