"""Matrix products that add into an existing tensor, as gradient accumulation needs them.

``add_matmul(out, a, b)`` is ``out += a @ b`` in one GEMM that adds in place: in ``out``'s dtype
when the operands share it, and for half-precision operands into an fp32 ``out`` through
``torch.addmm(..., out_dtype=float32)`` (the GEMM's fp32 result added without a rounding to the
operands' dtype first) where torch has it (CUDA builds of torch >= 2.8); elsewhere the product is
made and then added.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def fp32_accumulating_mm(device_type: str) -> bool:
    """Whether ``torch.addmm(fp32, bf16, bf16, out_dtype=float32, out=fp32)`` runs on ``device_type``."""
    if device_type != "cuda":
        return False
    try:
        acc = torch.zeros(2, 2, device=device_type)
        half = torch.ones(2, 2, device=device_type, dtype=torch.bfloat16)
        torch.addmm(acc, half, half, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return bool((acc == 2).all())


def add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` (2-D), in one GEMM where it can be (see the module docstring)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    elif out.dtype == torch.float32 and fp32_accumulating_mm(out.device.type):
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out.add_(a @ b)
