"""Blockwise FP8 (e4m3) quantisation and the FP8 linear layer's reference numerics.

DeepSeek-V3's recipe: activations and gradients are scaled per ``1 x 128`` block along the GEMM's
contraction dim, weights per ``128 x 128`` block, each block by ``amax / 448`` (448 is e4m3's
largest finite value) with fp32 scales. Small blocks keep one outlier from flushing its whole
row or tensor to zero, so no delayed-scaling history is needed. (Scales are ``amax * (1/448)``
in fp32; ``x / scale`` is an IEEE quotient.) Master weights stay in bf16 or
fp32 and are quantised at every forward.

The three GEMMs of ``y = x @ w.T + b`` run on quantised operands:

    forward  y  = Q1x128(x)          @ Q128x128(w).T
    dgrad    dx = Q1x128(dy)         @ Q128x128(w)
    wgrad    dw = Q1x128(dy.T)       @ Q1x128(x.T).T       (blocks run along the token dim)

``fp8_linear`` here computes them on dequantised operands in fp32: the numbers an exact FP8 GEMM
with fp32 accumulation gives. Its ``gemms`` argument names the GEMMs that run in FP8 (all three by
default); the others are plain matmuls in the input's dtype. It is the contract of the op
``fp8_linear`` (a ``loongforge.ops`` entry point of loongforge-llm), which the fused version in
``loongforge-kernels`` (real FP8 GEMMs, sm_89+) implements; it is what runs elsewhere. e4m3's
constants, ``Fp8Gemms`` and the input checks are core's (``loongforge.core.kernels.fp8_format``),
shared with the tensor-wise recipe and the fused op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge.core.kernels.fp8_format import (
    ALL_FP8, AMAX_FLOOR, FP8_DTYPE, FP8_MAX, INV_FP8_MAX, Fp8Gemms, check_gemms, check_linear,
)

BLOCK = 128  # the scaling block: 1 x 128 for activations and gradients, 128 x 128 for weights


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _check_matrix(op: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: expected a matrix, got shape {tuple(x.shape)}")


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> e4m3 ``q [R, C]`` and fp32 ``scale [R, ceil(C / 128)]`` with ``x ~ q * scale`` per block."""
    _check_matrix("quantize_1x128", x)
    rows, cols = x.shape
    nb = _blocks(cols)
    xf = F.pad(x.float(), (0, nb * BLOCK - cols)).view(rows, nb, BLOCK)
    scale = xf.abs().amax(-1).clamp_min(AMAX_FLOOR) * INV_FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, nb * BLOCK)[:, :cols].contiguous(), scale


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> e4m3 ``q [N, K]`` and fp32 ``scale [ceil(N / 128), ceil(K / 128)]``, one per 128x128 block."""
    _check_matrix("quantize_128x128", w)
    n, k = w.shape
    nbn, nbk = _blocks(n), _blocks(k)
    wf = F.pad(w.float(), (0, nbk * BLOCK - k, 0, nbn * BLOCK - n)).view(nbn, BLOCK, nbk, BLOCK)
    scale = wf.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR) * INV_FP8_MAX
    q = (wf / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nbn * BLOCK, nbk * BLOCK)[:n, :k].contiguous(), scale


def dequantize_1x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` for :func:`quantize_1x128`'s output."""
    cols = q.shape[1]
    return (q.float() * scale.repeat_interleave(BLOCK, dim=1)[:, :cols]).contiguous()


def dequantize_128x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` for :func:`quantize_128x128`'s output."""
    n, k = q.shape
    full = scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
    return q.float() * full


def round_1x128(x: torch.Tensor) -> torch.Tensor:
    """``x`` through 1x128 quantisation and back (fp32)."""
    return dequantize_1x128(*quantize_1x128(x))


def round_128x128(w: torch.Tensor) -> torch.Tensor:
    """``w`` through 128x128 quantisation and back (fp32)."""
    return dequantize_128x128(*quantize_128x128(w))


class _Fp8LinearReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, gemms: Fp8Gemms):
        if gemms.fprop:
            y = round_1x128(x2) @ round_128x128(weight).t()
            if bias is not None:
                y = y + bias.float()
            y = y.to(x2.dtype)
        else:
            y = x2 @ weight.to(x2.dtype).t()
            if bias is not None:
                y = y + bias.to(x2.dtype)
        ctx.save_for_backward(x2, weight)
        ctx.has_bias, ctx.gemms = bias is not None, gemms
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        gemms = ctx.gemms
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if gemms.dgrad:
                dx = (round_1x128(dy) @ round_128x128(weight)).to(x2.dtype)
            else:
                dx = dy @ weight.to(dy.dtype)
        if ctx.needs_input_grad[1]:
            if gemms.wgrad:
                dw = (round_1x128(dy.t()) @ round_1x128(x2.t()).t()).to(weight.dtype)
            else:
                dw = (dy.t() @ x2).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(dy.dtype)
        return dx, dw, db, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gemms: Fp8Gemms = ALL_FP8
) -> torch.Tensor:
    """``x @ weight.T + bias`` with the GEMMs ``gemms`` names on blockwise e4m3-rounded operands
    (fp32 math here), the others in ``x``'s dtype.

    ``x``: ``[..., K]``; ``weight``: ``[N, K]`` master weight (bf16/fp32); the output has ``x``'s
    dtype, the weight grad ``weight``'s. ``gemms`` (core's ``Fp8Gemms``, default all three) is
    the caller's choice and every implementation honours it: a GEMM in FP8 gives the numbers
    above; one not in FP8 is a plain matmul in ``x``'s dtype (``x @ w.T``, ``dy @ w``, ``dy.T @ x``
    with the weight cast to that dtype, the bias added in it, the weight grad cast to the
    weight's dtype). The op never chooses by itself (``fp8=adaptive``'s choice is the run's plan:
    ``loongforge.llm.layers.fp8_plan``).
    """
    check_linear("fp8_linear", x, weight, bias)
    check_gemms("fp8_linear", gemms)
    x2 = x.reshape(-1, x.shape[-1])
    return _Fp8LinearReference.apply(x2, weight, bias, gemms).view(*x.shape[:-1], weight.shape[0])
