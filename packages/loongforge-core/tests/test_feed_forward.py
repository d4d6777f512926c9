"""The tanh-GELU feed-forward's own autograd (``core.kernels.feed_forward``) against the same ops
composed by autograd, with the registry's reference ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongforge.core.kernels.feed_forward import FeedForwardKernels, feed_forward_kernels, gelu_feed_forward
from loongforge.core.kernels.fp8_tensorwise import fp8_linear_tensorwise
from loongforge.core.kernels.gelu import gelu_tanh_backward


def _params(k=32, f=64, n=48, dtype=torch.float32):
    torch.manual_seed(0)
    shapes = {"w1": (f, k), "b1": (f,), "w2": (n, f), "b2": (n,)}
    return {name: (torch.randn(s, dtype=dtype) / s[-1] ** 0.5).requires_grad_() for name, s in shapes.items()}


def _grads(fn, x, p):
    x = x.detach().clone().requires_grad_()
    y = fn(x, p)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return y.detach(), x.grad, {k: v.grad for k, v in p.items()}


def _composed(x, p):
    return F.linear(F.gelu(F.linear(x, p["w1"], p["b1"]), approximate="tanh"), p["w2"], p["b2"])


def _check_same(got, want, atol, rtol):
    (y, dx, dp), (wy, wdx, wdp) = got, want
    torch.testing.assert_close(y, wy, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx, wdx, atol=atol, rtol=rtol)
    for name in wdp:
        assert dp[name].dtype == wdp[name].dtype, name
        torch.testing.assert_close(dp[name], wdp[name], atol=atol, rtol=rtol, msg=name)


def test_equals_autograd_of_the_composed_ops_fp32():
    p = _params()
    x = torch.randn(3, 7, 32) * 2
    ours = _grads(lambda x, p: gelu_feed_forward(x, *p.values(), feed_forward_kernels(False)), x, p)
    want = _grads(_composed, x, {k: v.detach().clone().requires_grad_() for k, v in p.items()})
    assert ours[0].shape == (3, 7, 48)
    _check_same(ours, want, atol=1e-5, rtol=1e-5)


def test_autocast_bf16_computes_in_bf16_and_gives_fp32_parameter_grads():
    p = _params()
    x = torch.randn(40, 32)

    def under_autocast(fn):
        def run(x, p):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(x, p)
        return run

    ours = _grads(under_autocast(lambda x, p: gelu_feed_forward(x, *p.values(), feed_forward_kernels(False))), x, p)
    want = _grads(under_autocast(_composed), x, {k: v.detach().clone().requires_grad_() for k, v in p.items()})
    assert ours[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in ours[2].values())
    # bf16 GEMMs and GELU either way; ours sums the bias gradients in fp32
    _check_same(ours, want, atol=3e-2, rtol=3e-2)


def test_fp8_equals_the_composed_tensorwise_fp8_linears():
    """In fp32 the fused FP8 feed-forward is the two tensor-wise FP8 linears around the GELU."""
    p = _params()
    x = torch.randn(37, 32) * 3
    kernels = feed_forward_kernels(True)
    ours = _grads(lambda x, p: gelu_feed_forward(x, *p.values(), kernels), x, p)

    def composed(x, p):
        h = F.gelu(fp8_linear_tensorwise(x, p["w1"], p["b1"]), approximate="tanh")
        return fp8_linear_tensorwise(h, p["w2"], p["b2"])

    want = _grads(composed, x, {k: v.detach().clone().requires_grad_() for k, v in p.items()})
    _check_same(ours, want, atol=1e-5, rtol=1e-5)
    exact = _grads(_composed, x, {k: v.detach().clone().requires_grad_() for k, v in p.items()})
    rel = ((ours[0] - exact[0]).norm() / exact[0].norm()).item()
    assert 0 < rel < 0.1  # e4m3 rounding, no more


@pytest.mark.parametrize("fp8", [False, True])
def test_no_grad_forward_equals_the_autograd_forward(fp8):
    p = _params()
    x = torch.randn(21, 32)
    kernels = feed_forward_kernels(fp8)
    with_grad = gelu_feed_forward(x, *p.values(), kernels)
    with torch.no_grad():
        without = gelu_feed_forward(x, *p.values(), kernels)
    torch.testing.assert_close(without, with_grad.detach(), atol=1e-6, rtol=1e-6)


def test_gelu_tanh_backward_reference_contract():
    torch.manual_seed(1)
    h, dg = torch.randn(9, 5, requires_grad=True), torch.randn(9, 5)
    g = F.gelu(h, approximate="tanh")
    g.backward(dg)
    dh, db, amax, out = gelu_tanh_backward(dg, h.detach(), True)
    torch.testing.assert_close(dh, h.grad)
    torch.testing.assert_close(db, h.grad.sum(0))
    assert amax.item() == h.grad.abs().max().item() and amax.shape == ()
    torch.testing.assert_close(out, g.detach())
    assert gelu_tanh_backward(dg, h.detach(), False)[3].numel() == 0


def test_bad_shapes_name_the_op_and_shapes():
    p = _params()
    with pytest.raises(ValueError, match=r"gelu_feed_forward \(down\).*\(0, 64\) and \(48, 60\)"):
        gelu_feed_forward(torch.randn(4, 32), p["w1"], p["b1"], torch.randn(48, 60), None, feed_forward_kernels(True))
    with pytest.raises(ValueError, match=r"gelu_tanh_backward: expected matrices of one shape, got \[\(4, 5\), \(4, 6\)\]"):
        gelu_tanh_backward(torch.randn(4, 5), torch.randn(4, 6), False)
    assert FeedForwardKernels(gelu_tanh_backward).fp8_cast is None
