"""The tanh-GELU feed-forward's own autograd (``loongforge.diffusion.ops.feed_forward``) against the same ops
composed by autograd, with the registry's reference ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongforge.diffusion.ops.feed_forward import FeedForwardKernels, feed_forward_kernels, gelu_feed_forward
from loongforge.diffusion.ops.fp8_tensorwise import fp8_linear_tensorwise
from loongforge.diffusion.ops.gelu import gelu_tanh_backward, gelu_tanh_backward_in_place


def _params(k=32, f=64, n=48, dtype=torch.float32):
    torch.manual_seed(0)
    shapes = {"w1": (f, k), "b1": (f,), "w2": (n, f), "b2": (n,)}
    return {name: (torch.randn(s, dtype=dtype) / s[-1] ** 0.5).requires_grad_() for name, s in shapes.items()}


def _grads(fn, x, p):
    x = x.detach().clone().requires_grad_()
    y = fn(x, p)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return y.detach(), x.grad, {k: None if v is None else v.grad for k, v in p.items()}


def _composed(x, p):
    return F.linear(F.gelu(F.linear(x, p["w1"], p["b1"]), approximate="tanh"), p["w2"], p["b2"])


def _check_same(got, want, atol, rtol, names=("w1", "b1", "w2", "b2")):
    (y, dx, dp), (wy, wdx, wdp) = got, want
    torch.testing.assert_close(y, wy, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx, wdx, atol=atol, rtol=rtol)
    for name in names:
        if wdp[name] is None:
            assert dp[name] is None, name
            continue
        assert dp[name].dtype == wdp[name].dtype, name
        torch.testing.assert_close(dp[name], wdp[name], atol=atol, rtol=rtol, msg=name)


def _copy(p):
    return {k: None if v is None else v.detach().clone().requires_grad_(v.requires_grad) for k, v in p.items()}


def test_equals_autograd_of_the_composed_ops_fp32():
    p = _params()
    x = torch.randn(3, 7, 32) * 2
    ours = _grads(lambda x, p: gelu_feed_forward(x, *p.values(), feed_forward_kernels(False)), x, p)
    want = _grads(_composed, x, _copy(p))
    assert ours[0].shape == (3, 7, 48)
    _check_same(ours, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case", ["no biases", "frozen w1", "frozen w2 and b2", "strided 3-D x"])
def test_partial_gradients_and_layouts(fp8, case):
    """Missing biases, frozen parameters (only the gradients asked for) and a non-contiguous 3-D
    input give the composed ops' results."""
    p = _params()
    x = torch.randn(7, 32, 5).transpose(1, 2) if case == "strided 3-D x" else torch.randn(21, 32)
    if case == "no biases":
        p["b1"] = p["b2"] = None
    for name in {"frozen w1": ["w1"], "frozen w2 and b2": ["w2", "b2"]}.get(case, []):
        p[name].requires_grad_(False)
    kernels = feed_forward_kernels(fp8)
    ours = _grads(lambda x, p: gelu_feed_forward(x, *p.values(), kernels), x, p)

    def composed(x, p):
        if not fp8:
            return _composed(x, p)
        h = F.gelu(fp8_linear_tensorwise(x, p["w1"], p["b1"]), approximate="tanh")
        return fp8_linear_tensorwise(h, p["w2"], p["b2"])

    want = _grads(composed, x, _copy(p))
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
    want = _grads(under_autocast(_composed), x, _copy(p))
    assert ours[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in ours[2].values())
    # the same bf16 GEMMs and GELU: bitwise; ours sums the bias gradients in fp32 where autograd
    # sums bf16 (so those agree to bf16's precision)
    _check_same(ours, want, atol=0, rtol=0, names=("w1", "w2"))
    for name in ("b1", "b2"):
        rel = ((ours[2][name] - want[2][name]).norm() / want[2][name].norm()).item()
        assert rel < 1e-2, (name, rel)


def test_fp8_equals_the_composed_tensorwise_fp8_linears():
    """In fp32 the fused FP8 feed-forward is the two tensor-wise FP8 linears around the GELU."""
    p = _params()
    x = torch.randn(37, 32) * 3
    kernels = feed_forward_kernels(True)
    ours = _grads(lambda x, p: gelu_feed_forward(x, *p.values(), kernels), x, p)

    def composed(x, p):
        h = F.gelu(fp8_linear_tensorwise(x, p["w1"], p["b1"]), approximate="tanh")
        return fp8_linear_tensorwise(h, p["w2"], p["b2"])

    want = _grads(composed, x, _copy(p))
    _check_same(ours, want, atol=1e-5, rtol=1e-5)
    exact = _grads(_composed, x, _copy(p))
    rel = ((ours[0] - exact[0]).norm() / exact[0].norm()).item()
    assert 0 < rel < 0.1  # e4m3 rounding, no more


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_no_grad_forward_equals_the_autograd_forward(fp8, autocast):
    """Sampling and evaluation see the numbers training does, in bf16 too (exactly)."""
    p = _params()
    x = torch.randn(21, 32) * 3
    kernels = feed_forward_kernels(fp8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with_grad = gelu_feed_forward(x, *p.values(), kernels)
        with torch.no_grad():
            without = gelu_feed_forward(x, *p.values(), kernels)
    assert without.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(without, with_grad.detach(), atol=0, rtol=0)


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
    with pytest.raises(ValueError, match=r"gelu_feed_forward: expected w1 \[F, K\] and w2 \[N, F\]; got \(64, 32\) and \(48, 60\)"):
        gelu_feed_forward(torch.randn(4, 32), p["w1"], p["b1"], torch.randn(48, 60), None, feed_forward_kernels(False))
    with pytest.raises(ValueError, match=r"gelu_feed_forward: w2 \(40, 64\): FP8 GEMMs need both dims to be multiples of 16"):
        gelu_feed_forward(torch.randn(4, 32), p["w1"], p["b1"], torch.randn(40, 64), None, feed_forward_kernels(True))
    with pytest.raises(ValueError, match=r"gelu_feed_forward: b2 must be \[48\], got \(5,\)"):
        gelu_feed_forward(torch.randn(4, 32), p["w1"], p["b1"], p["w2"], torch.randn(5), feed_forward_kernels(False))
    with pytest.raises(ValueError, match=r"gelu_tanh_backward: expected matrices of one shape, got \[\(4, 5\), \(4, 6\)\]"):
        gelu_tanh_backward(torch.randn(4, 5), torch.randn(4, 6), False)
    assert not FeedForwardKernels(gelu_tanh_backward, gelu_tanh_backward_in_place).fp8
