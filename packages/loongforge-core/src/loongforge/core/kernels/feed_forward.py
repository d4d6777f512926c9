"""Tanh-GELU feed-forward ``down(gelu(up(x)))`` with its own backward, in the autocast dtype or
with tensor-wise FP8 GEMMs.

Autograd's backward of the three ops reads the hidden activation ``h = up(x)`` (``[tokens,
ffn_dim]``) several times: the GELU backward, the up-projection's bias gradient, the recomputed
``gelu(h)`` for the down-projection's weight gradient and, in FP8, the amax of the gradient to
cast. Here one registry op (``gelu_tanh_backward``) does all of it in one pass, and in FP8 the
forward casts ``gelu(h)`` straight from ``h`` (``gelu_fp8_cast_transpose``) without writing it.

``kernels``: the registry ops to use (:func:`feed_forward_kernels`), resolved once by the caller.
Numerics are those of the same ops composed: ``gelu`` in fp32 from the autocast-dtype ``h``, the
weight gradients of the GEMMs cast to the weights' dtype, bias gradients summed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loongforge.core.kernels.fp8 import AMAX_FLOOR
from loongforge.core.kernels.fp8_tensorwise import (
    E5M2, cast_operand, check_tensorwise_linear, forward_gemm, forward_gemm_no_grad, linear_grads,
)
from loongforge.core.kernels.registry import get_kernel


@dataclass(frozen=True)
class FeedForwardKernels:
    gelu_backward: Callable  # the registry's gelu_tanh_backward
    fp8_cast: Callable | None = None  # fp8_cast_transpose and gelu_fp8_cast_transpose: FP8 GEMMs
    gelu_fp8_cast: Callable | None = None


def feed_forward_kernels(fp8: bool) -> FeedForwardKernels:
    """The registry ops of a feed-forward in the autocast dtype, or with FP8 GEMMs (``fp8``)."""
    if not fp8:
        return FeedForwardKernels(get_kernel("gelu_tanh_backward"))
    return FeedForwardKernels(get_kernel("gelu_tanh_backward"), get_kernel("fp8_cast_transpose"),
                              get_kernel("gelu_fp8_cast_transpose"))


class _GeluFeedForward(torch.autograd.Function):
    """The GEMMs in ``x``'s dtype; saves ``x`` and ``h`` (``gelu(h)`` is recomputed by the
    backward's one pass over ``h``)."""

    @staticmethod
    def forward(ctx, x2, w1, b1, w2, b2, gelu_backward):
        dt = x2.dtype
        w1c, w2c = w1.to(dt), w2.to(dt)
        h = F.linear(x2, w1c, None if b1 is None else b1.to(dt))
        y = F.linear(F.gelu(h, approximate="tanh"), w2c, None if b2 is None else b2.to(dt))
        ctx.save_for_backward(x2, w1c, h, w2c)
        ctx.gelu_backward, ctx.w_dtypes = gelu_backward, (w1.dtype, w2.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w1c, h, w2c = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2, _ = ctx.needs_input_grad
        dg = dy @ w2c
        dh, db1, _, g = ctx.gelu_backward(dg, h, need_w2)
        dx = dh @ w1c if need_x else None
        dw1 = (dh.t() @ x2).to(ctx.w_dtypes[0]) if need_w1 else None
        dw2 = (dy.t() @ g).to(ctx.w_dtypes[1]) if need_w2 else None
        db2 = dy.float().sum(0) if need_b2 else None
        return dx, dw1, db1 if need_b1 else None, dw2, db2, None


class _Fp8GeluFeedForward(torch.autograd.Function):
    """All six GEMMs in tensor-wise FP8 (``fp8_tensorwise``); saves the transposed FP8 copies the
    weight gradients read and ``h``."""

    @staticmethod
    def forward(ctx, x2, w1, b1, w2, b2, kernels: FeedForwardKernels):
        cast = kernels.fp8_cast
        x_q, x_t, x_scale = cast_operand(x2, cast, False)
        w1_q, w1_t, w1_scale = cast_operand(w1, cast, False)
        h = forward_gemm(x_q, w1_q, x_scale, w1_scale, b1, x2.dtype)
        g_q, g_t, g_scale = kernels.gelu_fp8_cast(h)
        w2_q, w2_t, w2_scale = cast_operand(w2, cast, False)
        ctx.save_for_backward(x_t, x_scale, w1_t, w1_scale, h, g_t, g_scale, w2_t, w2_scale)
        ctx.kernels, ctx.x_dtype = kernels, x2.dtype
        return forward_gemm(g_q, w2_q, g_scale, w2_scale, b2, x2.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_t, x_scale, w1_t, w1_scale, h, g_t, g_scale, w2_t, w2_scale = ctx.saved_tensors
        k, needs = ctx.kernels, ctx.needs_input_grad
        dy_q, dy_t, dy_scale = cast_operand(dy, k.fp8_cast, True)
        dg, dw2 = linear_grads(dy_q, dy_t, dy_scale, w2_t, w2_scale, g_t, g_scale, h.dtype, True, needs[3])
        db2 = dy.float().sum(0) if needs[4] else None
        dh, db1, dh_amax, _ = k.gelu_backward(dg, h, False)
        dh_scale = dh_amax.clamp_min(AMAX_FLOOR) / torch.finfo(E5M2).max
        dh_q, dh_t = k.fp8_cast(dh, dh_scale, True)
        dx, dw1 = linear_grads(dh_q, dh_t, dh_scale, w1_t, w1_scale, x_t, x_scale, ctx.x_dtype, needs[0], needs[1])
        return dx, dw1, db1 if needs[2] else None, dw2, db2, None


def gelu_feed_forward(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    kernels: FeedForwardKernels,
) -> torch.Tensor:
    """``F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)`` over ``x [..., K]``
    (``w1 [F, K]``, ``w2 [N, F]``), in the autocast dtype where autocast is on, with FP8 GEMMs
    when ``kernels`` has FP8 casts. Parameters get gradients in their own dtype."""
    fp8 = kernels.fp8_cast is not None
    if fp8:
        check_tensorwise_linear("gelu_feed_forward (up)", x, w1, b1)
        check_tensorwise_linear("gelu_feed_forward (down)", x.new_empty(0, w1.shape[0]), w2, b2)
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    x2 = x.reshape(-1, x.shape[-1])
    params = (w1, b1, w2, b2)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, *params))):
        if fp8:  # no backward: no transposed copies
            h = forward_gemm_no_grad(x2, w1, b1)
            y = forward_gemm_no_grad(F.gelu(h, approximate="tanh"), w2, b2)
        else:
            dt = x2.dtype
            h = F.gelu(F.linear(x2, w1.to(dt), None if b1 is None else b1.to(dt)), approximate="tanh")
            y = F.linear(h, w2.to(dt), None if b2 is None else b2.to(dt))
    elif fp8:
        y = _Fp8GeluFeedForward.apply(x2, *params, kernels)
    else:
        y = _GeluFeedForward.apply(x2, *params, kernels.gelu_backward)
    return y.view(*x.shape[:-1], w2.shape[0])
