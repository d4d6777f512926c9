"""Tensor-wise FP8 linear: quantisation, the three GEMMs against their numbers on dequantised
operands, autocast dtypes and clear errors (CPU torch runs per-tensor ``_scaled_mm``)."""

from __future__ import annotations

import pytest
import torch

from loongforge.diffusion.ops.fp8_tensorwise import (
    E4M3,
    E5M2,
    fp8_linear_tensorwise,
    quantize,
    quantize_transposed,
    tensor_scale,
)


def _dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = tensor_scale(t, dtype)
    return quantize(t, dtype, scale).float() * scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_spans_the_format_and_rounds_to_nearest(dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 50) * 3
    scale = tensor_scale(x, dtype)
    q = quantize(x, dtype, scale)
    fmax = torch.finfo(dtype).max
    assert q.dtype == dtype and q.is_contiguous()
    assert q.float().abs().max() == fmax  # the largest |x| lands on the format's largest value
    # round to nearest: relative error at most half the significand spacing (e4m3: 2^-3, e5m2: 2^-2)
    eps = 2.0**-3 if dtype == E4M3 else 2.0**-2
    normal = (x / scale).abs() >= torch.finfo(dtype).smallest_normal
    err = (q.float() * scale - x).abs()[normal] / x.abs()[normal]
    assert err.max() <= eps / 2 * (1 + 1e-6)
    # the transposed copy: tokens zero-padded to a multiple of 16
    qt = quantize_transposed(x, dtype, scale)
    assert qt.shape == (50, 48) and qt.is_contiguous()
    assert torch.equal(qt[:, :37].float(), q.t().float()) and (qt[:, 37:].float() == 0).all()
    # an all-zero tensor stays zero (the scale is floored, never 0/0)
    assert (quantize(torch.zeros(3, 16), dtype, tensor_scale(torch.zeros(3, 16), dtype)).float() == 0).all()


def test_gemms_equal_their_dequantised_numbers():
    """Forward, input grad and weight grad are the fp32 products of the quantised operands
    (x, w e4m3; dy e5m2), over a token count that is not a multiple of 16; the bias grad is exact."""
    torch.manual_seed(1)
    x = torch.randn(2, 20, 64, requires_grad=True)  # 40 tokens
    w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    y = fp8_linear_tensorwise(x, w, b)
    dy = torch.randn_like(y)
    y.backward(dy)

    x2, dy2 = x.detach().reshape(40, 64), dy.reshape(40, 48)
    xq, wq, dyq = _dequantized(x2, E4M3), _dequantized(w.detach(), E4M3), _dequantized(dy2, E5M2)
    tol = dict(atol=1e-4, rtol=1e-5)
    assert y.shape == (2, 20, 48)
    torch.testing.assert_close(y.reshape(40, 48), xq @ wq.t() + b.detach(), **tol)
    torch.testing.assert_close(x.grad.reshape(40, 64), dyq @ wq, **tol)
    torch.testing.assert_close(w.grad, dyq.t() @ xq, **tol)
    torch.testing.assert_close(b.grad, dy2.sum(0), **tol)
    # and FP8 stays near the exact linear: e4m3/e5m2 rounding of random operands
    exact = x2 @ w.detach().t() + b.detach()
    assert ((y.reshape(40, 48) - exact).norm() / exact.norm()) < 0.06


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_autocast_dtypes_and_no_bias(x_dtype):
    """Under bf16 autocast the output is bf16 whatever x's dtype (as F.linear's), x's grad has x's
    dtype and the fp32 master weight gets an fp32 grad; without a bias nothing is added."""
    torch.manual_seed(2)
    x = torch.randn(24, 32, dtype=x_dtype, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear_tensorwise(x, w)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == x_dtype and w.grad.dtype == torch.float32
    want = _dequantized(x.detach().bfloat16().float(), E4M3) @ _dequantized(w.detach(), E4M3).t()
    torch.testing.assert_close(y.float(), want, atol=0.05, rtol=1e-2)  # bf16 output rounding


def test_without_autograd_the_same_output():
    """Under no_grad (sampling) the forward skips the transposed copies and gives the same numbers."""
    torch.manual_seed(3)
    x, w, b = torch.randn(40, 64), torch.randn(48, 64, requires_grad=True), torch.randn(48)
    with_grad = fp8_linear_tensorwise(x, w, b)
    assert with_grad.requires_grad
    with torch.no_grad():
        without = fp8_linear_tensorwise(x, w, b)
    assert not without.requires_grad
    torch.testing.assert_close(without, with_grad.detach(), atol=0, rtol=0)


@pytest.mark.parametrize(
    "x_shape, w_shape, bias_shape, match",
    [
        ((4, 40), (48, 40), None, r"weight \[48, 40\]: FP8 GEMMs need both dims to be multiples of 16"),
        ((4, 64), (40, 64), None, r"weight \[40, 64\]"),
        ((4, 32), (48, 64), None, r"expected x \[\.\.\., K\] and weight \[N, K\]"),
        ((4, 64), (48, 64), (47,), r"bias must be \[48\]"),
    ],
)
def test_bad_shapes_are_clear_errors(x_shape, w_shape, bias_shape, match):
    bias = torch.zeros(bias_shape) if bias_shape else None
    with pytest.raises(ValueError, match=match):
        fp8_linear_tensorwise(torch.randn(x_shape), torch.randn(w_shape), bias)
