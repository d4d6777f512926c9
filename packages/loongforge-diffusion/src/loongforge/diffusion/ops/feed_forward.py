"""Tanh-GELU feed-forward ``down(gelu(up(x)))`` with its own backward, in the autocast dtype or
with tensor-wise FP8 GEMMs.

Autograd's backward of the three ops reads the hidden activation ``h = up(x)`` (``[tokens,
ffn_dim]``) several times: the GELU backward, the up-projection's bias gradient, the recomputed
``gelu(h)`` for the down-projection's weight gradient and, in FP8, the amax of the gradient to
cast. Here one registry op makes ``dh``, the bias gradient (and in FP8 the amax) in one pass: in
the autocast dtype written over ``dg`` (``gelu_tanh_backward_in_place``: see ``_GeluFeedForward``),
in FP8 beside it (``gelu_tanh_backward``); and in FP8 the forward casts ``gelu(h)`` straight from
``h`` (``gelu_fp8_cast_transpose``) without writing it.

``kernels``: the registry ops to use (:func:`feed_forward_kernels`), resolved once by the caller.
Numerics: in the autocast dtype, those of the same ops composed (the output and the input and
weight gradients bitwise), with the bias gradients summed in fp32. With FP8 GEMMs, ``gelu(h)`` is
quantised from fp32 (not from ``h``'s dtype, as ``fp8_linear_tensorwise(F.gelu(h))`` would), so
in bf16 the outputs differ from that composition by the rounding of ``gelu(h)`` to bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loongforge.core.kernels.fp8_format import ALIGN, E4M3, E5M2, scale_from_amax, tensor_scale
from loongforge.core.kernels.registry import get_kernel
from loongforge.diffusion.ops.fp8_tensorwise import (
    cast_operand, check_tensorwise_linear, forward_gemm, forward_gemm_no_grad, linear_grads, quantize,
)


@dataclass(frozen=True)
class FeedForwardKernels:
    """The registry ops a feed-forward calls (FP8 casts only with FP8 GEMMs): the backward in the
    autocast dtype runs ``gelu_tanh_backward_in_place``, the FP8 one ``gelu_tanh_backward``."""

    gelu_tanh_backward: Callable
    gelu_tanh_backward_in_place: Callable
    fp8_cast_transpose: Callable | None = None
    gelu_fp8_cast_transpose: Callable | None = None

    @property
    def fp8(self) -> bool:
        return self.fp8_cast_transpose is not None

    def fp8_casts(self) -> tuple[Callable, Callable]:
        """``(fp8_cast_transpose, gelu_fp8_cast_transpose)``, which the FP8 path calls."""
        if self.fp8_cast_transpose is None or self.gelu_fp8_cast_transpose is None:
            raise ValueError("gelu_feed_forward: these kernels have no FP8 casts (feed_forward_kernels(fp8=True))")
        return self.fp8_cast_transpose, self.gelu_fp8_cast_transpose


def feed_forward_kernels(fp8: bool) -> FeedForwardKernels:
    """The registry ops of a feed-forward in the autocast dtype, or with FP8 GEMMs (``fp8``)."""
    backward = (get_kernel("gelu_tanh_backward"), get_kernel("gelu_tanh_backward_in_place"))
    if not fp8:
        return FeedForwardKernels(*backward)
    return FeedForwardKernels(*backward, get_kernel("fp8_cast_transpose"), get_kernel("gelu_fp8_cast_transpose"))


def _forward_in_dtype(x2, w1, b1, w2, b2):
    """``(w1, h, w2, y)`` with the weights cast to ``x2``'s dtype and ``h = up(x2)``."""
    dt = x2.dtype
    w1c, w2c = w1.to(dt), w2.to(dt)
    h = F.linear(x2, w1c, None if b1 is None else b1.to(dt))
    return w1c, h, w2c, F.linear(F.gelu(h, approximate="tanh"), w2c, None if b2 is None else b2.to(dt))


class _GeluFeedForward(torch.autograd.Function):
    """The GEMMs in ``x``'s dtype; saves ``x`` and ``h`` (``gelu(h)`` is recomputed in the backward).

    Memory: besides ``h`` the backward keeps one ``[tokens, ffn_dim]`` tensor alive at a time:
    ``gelu(h)`` for the down-projection's weight gradient, freed before the gradient ``dg`` of the
    GELU's output exists, which ``gelu_tanh_backward_in_place`` then turns into ``dh`` in place. Autograd of the composed ops (diffusers' ``FeedForward``) keeps two
    (``dg`` and ``dh``); writing ``dh`` and ``gelu(h)`` beside ``dg`` kept three, on the whole Wan
    1.3B at 32760 tokens about 1 GiB above diffusers' checkpointed step. Gradients come back in
    the GEMMs' dtype; autograd casts them to each parameter's."""

    @staticmethod
    def forward(ctx, x2, w1, b1, w2, b2, kernels: FeedForwardKernels):
        w1c, h, w2c, y = _forward_in_dtype(x2, w1, b1, w2, b2)
        ctx.save_for_backward(x2, w1c, h, w2c)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w1c, h, w2c = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2, _ = ctx.needs_input_grad
        dx = dw1 = db1 = dw2 = None
        if need_w2:  # gelu(h) lives only for this GEMM
            dw2 = dy.t() @ F.gelu(h, approximate="tanh")
        if need_x or need_w1 or need_b1:
            dh = dy @ w2c  # dg, overwritten with dh
            db1 = (ctx.kernels.gelu_tanh_backward_in_place(dh, h) if dh.shape[0]  # (no token: no pass)
                   else dh.new_zeros(dh.shape[1], dtype=torch.float32))
            dx = dh @ w1c if need_x else None
            dw1 = dh.t() @ x2 if need_w1 else None
        db2 = dy.float().sum(0) if need_b2 else None
        return dx, dw1, db1 if need_b1 else None, dw2, db2, None


class _Fp8GeluFeedForward(torch.autograd.Function):
    """All six GEMMs in tensor-wise FP8 (``fp8_tensorwise``); saves the transposed FP8 copies the
    weight gradients read and ``h``."""

    @staticmethod
    def forward(ctx, x2, w1, b1, w2, b2, kernels: FeedForwardKernels):
        cast, gelu_cast = kernels.fp8_casts()
        x_q, x_t, x_scale = cast_operand(x2, cast, False)
        w1_q, w1_t, w1_scale = cast_operand(w1, cast, False)
        h = forward_gemm(x_q, w1_q, x_scale, w1_scale, b1, x2.dtype)
        g_q, g_t, g_scale = gelu_cast(h)
        w2_q, w2_t, w2_scale = cast_operand(w2, cast, False)
        ctx.save_for_backward(x_t, x_scale, w1_t, w1_scale, h, g_t, g_scale, w2_t, w2_scale)
        ctx.kernels = kernels
        return forward_gemm(g_q, w2_q, g_scale, w2_scale, b2, x2.dtype)

    @staticmethod
    def backward(ctx, dy):
        x_t, x_scale, w1_t, w1_scale, h, g_t, g_scale, w2_t, w2_scale = ctx.saved_tensors
        k = ctx.kernels
        cast, _ = k.fp8_casts()
        need_x, need_w1, need_b1, need_w2, need_b2, _ = ctx.needs_input_grad
        need_dh = need_x or need_w1 or need_b1
        dy_q, dy_t, dy_scale = cast_operand(dy, cast, True)
        dg, dw2 = linear_grads(dy_q, dy_t, dy_scale, w2_t, w2_scale, g_t, g_scale, h.dtype, need_dh, need_w2)
        db2 = dy.float().sum(0) if need_b2 else None
        dx = dw1 = db1 = None
        if need_dh:
            dh, db1, dh_amax, _ = k.gelu_tanh_backward(dg, h, False)
            del dg  # (one [tokens, ffn_dim] tensor fewer while dh's casts are made)
            dh_scale = scale_from_amax(dh_amax, E5M2)
            dh_q, dh_t = cast(dh, dh_scale, True)
            dx, dw1 = linear_grads(dh_q, dh_t, dh_scale, w1_t, w1_scale, x_t, x_scale, h.dtype, need_x, need_w1)
        return dx, dw1, db1 if need_b1 else None, dw2, db2, None


def _check_shapes(x, w1, b1, w2, b2, fp8: bool) -> None:
    """Clear errors naming the operands a feed-forward cannot take."""
    if w2.dim() != 2 or w1.dim() != 2 or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"gelu_feed_forward: expected w1 [F, K] and w2 [N, F]; got {tuple(w1.shape)} and {tuple(w2.shape)}")
    if b2 is not None and tuple(b2.shape) != (w2.shape[0],):
        raise ValueError(f"gelu_feed_forward: b2 must be [{w2.shape[0]}], got {tuple(b2.shape)}")
    if fp8:
        check_tensorwise_linear("gelu_feed_forward", x, w1, b1)
        if w2.shape[0] % ALIGN:
            raise ValueError(f"gelu_feed_forward: w2 {tuple(w2.shape)}: FP8 GEMMs need both dims to be multiples of {ALIGN}")


def gelu_feed_forward(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    kernels: FeedForwardKernels,
) -> torch.Tensor:
    """``F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)`` over ``x [..., K]``
    (``w1 [F, K]``, ``w2 [N, F]``), in the autocast dtype where autocast is on, with FP8 GEMMs
    when ``kernels`` has FP8 casts. Parameters get gradients in their own dtype. With and without
    autograd the forward computes the same numbers (without, no transposed FP8 copies are kept)."""
    _check_shapes(x, w1, b1, w2, b2, kernels.fp8)
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    x2 = x.reshape(-1, x.shape[-1])
    params = (w1, b1, w2, b2)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, *params)):
        function = _Fp8GeluFeedForward if kernels.fp8 else _GeluFeedForward
        y = function.apply(x2, *params, kernels)
    elif kernels.fp8:
        h = forward_gemm_no_grad(x2, w1, b1)
        g_q, _, g_scale = kernels.fp8_casts()[1](h)
        w2_scale = tensor_scale(w2, E4M3)
        y = forward_gemm(g_q, quantize(w2, E4M3, w2_scale), g_scale, w2_scale, b2, x2.dtype)
    else:
        y = _forward_in_dtype(x2, *params)[3]
    return y.view(*x.shape[:-1], w2.shape[0])
