"""What every FP8 linear of LoongForge shares, whatever its scaling recipe (tensor-wise here in
``fp8_tensorwise.py``, blockwise in loongforge-llm): e4m3's range, the floor of a scale's amax,
and the inputs an FP8 linear takes."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# scale = amax * (1 / 448): a product, which every device rounds alike (CUDA torch turns a division
# by a Python scalar into this product anyway, so a quotient would differ between devices)
INV_FP8_MAX = 1.0 / FP8_MAX
# Blocks whose amax is below this get the scale this amax would give: all-zero blocks stay zero
# and the scale never underflows.
AMAX_FLOOR = 1e-12


def check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Clear errors for inputs an FP8 linear cannot take."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: expected x [..., K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{op}: {name} must be a bf16/fp16/fp32 tensor (it is quantised inside), got {t.dtype}")
