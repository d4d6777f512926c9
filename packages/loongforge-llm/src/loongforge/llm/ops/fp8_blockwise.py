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
with fp32 accumulation gives. It is the contract of the op ``fp8_linear`` (a ``loongforge.ops``
entry point of loongforge-llm), which the fused version in ``loongforge-kernels`` (real FP8
GEMMs, sm_89+) implements; it is what runs elsewhere. e4m3's constants and the input check are
core's (``loongforge.core.kernels.fp8_format``), shared with the tensor-wise recipe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge.core.kernels.fp8_format import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, INV_FP8_MAX, check_linear

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
    def forward(ctx, x2, weight, bias):
        w_r = round_128x128(weight)
        y = round_1x128(x2) @ w_r.t()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (round_1x128(dy) @ round_128x128(weight)).to(x2.dtype)
        if ctx.needs_input_grad[1]:
            dw = (round_1x128(dy.t()) @ round_1x128(x2.t()).t()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(dy.dtype)
        return dx, dw, db


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, adaptive: bool = False
) -> torch.Tensor:
    """``x @ weight.T + bias`` with every GEMM on blockwise e4m3-rounded operands (fp32 math here).

    ``x``: ``[..., K]``; ``weight``: ``[N, K]`` master weight (bf16/fp32); the output has ``x``'s
    dtype, the weight grad ``weight``'s. ``adaptive=True`` lets an implementation run a GEMM in
    bf16 where its measured FP8 form is slower (more accurate, never less); this reference
    always rounds.
    """
    check_linear("fp8_linear", x, weight, bias)
    del adaptive
    x2 = x.reshape(-1, x.shape[-1])
    return _Fp8LinearReference.apply(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
