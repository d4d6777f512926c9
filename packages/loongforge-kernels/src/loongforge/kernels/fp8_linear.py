"""Blockwise FP8 linear layer with FP8 forward and backward GEMMs.

Contract: ``fp8_linear`` (loongforge-llm's ``loongforge.llm.ops.fp8_blockwise``). The forward
quantises ``x`` (1x128) and the master weight (128x128) and runs ``y = x @ w.T`` in FP8; it saves the weight's e4m3 copy
for the input-grad GEMM and ``x`` quantised along the token dim (transposed, 1 byte per element)
for the weight-grad GEMM, so no bf16 activation is kept. The backward quantises ``dy`` both ways
(for a narrow ``dy``, as for ``x`` in the forward, both copies from one read) and runs ``dx = dy @ w`` and ``dw = dy.T @ x`` in FP8 (see ``fp8_gemm`` for the GEMMs).

``gemms`` (core's ``Fp8Gemms``) says which of the three GEMMs run in FP8; the others run in the
input's dtype (the weight cast to it), and what they need is saved unquantised. The op never
chooses: FP8 is not faster for every shape (quantising costs memory passes, and small or skinny
GEMMs are bound by them), and the caller decides once per run -- loongforge-llm's ``fp8=adaptive``
times this op in each choice at the run's shapes and hands every linear the agreed one
(``loongforge.llm.layers.fp8_plan``). This module keeps no state between calls.
"""

from __future__ import annotations

import torch

from loongforge.core.kernels.fp8_format import ALL_FP8, Fp8Gemms, check_gemms, check_linear
from loongforge.kernels import fp8_gemm as gemm


# the widest activation (columns) that one read for both quantised copies is faster for: at 2048
# columns it took 52 us against 69 for the two quantisers on an H100 (8192 rows), from 3072 columns
# on it was slower (bench/fp8_quantisers.py, docs/benchmarks.md)
ONE_READ_MAX_COLS = 2048


def _quantize_both_ways(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t``'s 1x128 copy and its transposed one (the same numbers either way), by whichever is faster."""
    if t.shape[1] <= ONE_READ_MAX_COLS:
        return gemm.quantize_1x128_both(t)
    return (*gemm.quantize_1x128(t), *gemm.quantize_1x128_transposed(t))


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, gemms: Fp8Gemms):
        out_dtype = x2.dtype
        if gemms.fprop or gemms.dgrad:
            wq, ws = gemm.quantize_128x128(weight)
        dgrad_saved: tuple[torch.Tensor, ...] = (weight,)
        if gemms.dgrad:  # the e4m3 weight, K-major for dx = dy @ w
            dgrad_saved = (wq.t().contiguous(), ws.t().contiguous())
        wgrad_saved: tuple[torch.Tensor, ...] = (x2,)
        if gemms.fprop and gemms.wgrad:
            xq, xs, xq_t, xs_t = _quantize_both_ways(x2)
            wgrad_saved = (xq_t, xs_t)
        elif gemms.fprop:
            xq, xs = gemm.quantize_1x128(x2)
        elif gemms.wgrad:
            wgrad_saved = gemm.quantize_1x128_transposed(x2)
        if gemms.fprop:
            y = gemm.fp8_gemm(xq, xs, wq, ws, True, out_dtype)
        else:
            y = x2 @ weight.to(out_dtype).t()
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(*dgrad_saved, *wgrad_saved)
        ctx.n_dgrad = len(dgrad_saved)
        ctx.gemms, ctx.has_bias, ctx.w_dtype = gemms, bias is not None, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        dgrad_saved, wgrad_saved = saved[: ctx.n_dgrad], saved[ctx.n_dgrad :]
        gemms = ctx.gemms
        dy = dy.contiguous()
        dx = dw = db = None
        want_dx = ctx.needs_input_grad[0]
        want_dw = ctx.needs_input_grad[1]
        # dy's 1x128 copy (for dgrad) and its transposed one (for wgrad)
        dy_q = dy_s = dy_qt = dy_st = None
        if want_dx and gemms.dgrad and want_dw and gemms.wgrad:
            dy_q, dy_s, dy_qt, dy_st = _quantize_both_ways(dy)
        elif want_dx and gemms.dgrad:
            dy_q, dy_s = gemm.quantize_1x128(dy)
        elif want_dw and gemms.wgrad:
            dy_qt, dy_st = gemm.quantize_1x128_transposed(dy)
        if want_dx:
            if gemms.dgrad:
                dx = gemm.fp8_gemm(dy_q, dy_s, *dgrad_saved, True, dy.dtype)
                del dy_q, dy_s  # (not needed by the weight gradient)
            else:
                dx = dy @ dgrad_saved[0].to(dy.dtype)
        if want_dw:
            if gemms.wgrad:
                dw = gemm.fp8_gemm(dy_qt, dy_st, *wgrad_saved, False, ctx.w_dtype)
            else:
                dw = (dy.t() @ wgrad_saved[0]).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(dy.dtype)
        return dx, dw, db, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gemms: Fp8Gemms = ALL_FP8
) -> torch.Tensor:
    """Fused ``fp8_linear``: real e4m3 GEMMs, forward and backward, for the GEMMs ``gemms`` names."""
    check_linear("fp8_linear", x, weight, bias)
    check_gemms("fp8_linear", gemms)
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    return _Fp8Linear.apply(x2, weight, bias, gemms).view(*x.shape[:-1], weight.shape[0])
