"""Triton device functions of the tanh-approximated GELU (PyTorch's ``approximate="tanh"``),
shared by the kernels that apply it on the fly."""

from __future__ import annotations

import triton
import triton.language as tl

SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
KAPPA: tl.constexpr = tl.constexpr(0.044715)
TWO_LOG2_E: tl.constexpr = tl.constexpr(2.885390081777927)  # 2 / ln(2)


@triton.jit
def tanh(u):
    """fp32 ``tanh(u) = 1 - 2 / (e^(2u) + 1)`` from the hardware exp2 and an approximate division
    (a few fp32 ulps from torch's; exact +-1 in the tails, where e^(2u) is 0 or inf): the GELU
    kernels are bound by memory only when the GELU costs a handful of instructions."""
    return 1.0 - tl.fdiv(2.0, tl.exp2(TWO_LOG2_E * u) + 1.0)


@triton.jit
def gelu_tanh_and_slope(y):
    """``(gelu(y), d gelu / dy)`` of fp32 ``y``: ``gelu(y) = y/2 (1 + tanh(sqrt(2/pi) (y + 0.044715 y^3)))``."""
    y2 = y * y
    t = tanh(SQRT_2_OVER_PI * (y + KAPPA * y2 * y))
    slope = 0.5 * (1.0 + t) + 0.5 * y * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * KAPPA * y2)
    return 0.5 * y * (1.0 + t), slope


@triton.jit
def gelu_tanh(y):
    """``gelu(y)`` of fp32 ``y`` (the compiler drops the unused slope)."""
    return gelu_tanh_and_slope(y)[0]
