"""Fused rms_norm / add_rms_norm / rms_norm_with_residual vs the torch reference (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels import reference
from loongforge.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_with_residual

TIGHT = dict(rtol=1e-5, atol=1e-5)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("shape", [(3, 5, 67), (15, 128), (1, 1)])
def test_rms_norm_forward_backward_fp32(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    w = torch.randn(shape[-1])
    dy = torch.randn(shape)
    xf, wf = _leaves(x, w)
    xr, wr = _leaves(x, w)

    y = rms_norm(xf, wf, 1e-5)
    y.backward(dy)
    y_ref = reference.rms_norm(xr, wr, 1e-5)
    y_ref.backward(dy)

    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(xf.grad, xr.grad, **TIGHT)
    torch.testing.assert_close(wf.grad, wr.grad, **TIGHT)


def test_rms_norm_non_contiguous_input_and_frozen_weight():
    torch.manual_seed(1)
    base = torch.randn(40, 6)
    x = base.t()  # [6, 40], last-dim stride 6
    w = torch.randn(40)
    dy = torch.randn(6, 40)
    (xf,) = _leaves(x)
    (xr,) = _leaves(x)
    assert not xf.is_contiguous()
    y = rms_norm(xf, w)
    y.backward(dy)
    reference.rms_norm(xr, w).backward(dy)
    torch.testing.assert_close(y, reference.rms_norm(x, w), **TIGHT)
    torch.testing.assert_close(xf.grad, xr.grad, **TIGHT)


@pytest.mark.parametrize("use_sum_grad", [True, False])
def test_add_rms_norm_forward_backward_fp32(use_sum_grad):
    torch.manual_seed(2)
    shape = (2, 7, 96)
    x, r, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    dy, ds = torch.randn(shape), torch.randn(shape)
    fused_in = _leaves(x, r, w)
    ref_in = _leaves(x, r, w)

    y, s = add_rms_norm(*fused_in, 1e-6)
    y_ref, s_ref = reference.add_rms_norm(*ref_in, 1e-6)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    torch.testing.assert_close(s, s_ref, **TIGHT)

    outs, refs, grads = ((y, s), (y_ref, s_ref), (dy, ds)) if use_sum_grad else ((y,), (y_ref,), (dy,))
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    for got, want in zip(fused_in, ref_in):
        torch.testing.assert_close(got.grad, want.grad, **TIGHT)


@pytest.mark.parametrize("use_residual", [True, False])
def test_rms_norm_with_residual_sums_both_gradients_in_its_backward(use_residual):
    """The passed-on input's gradient and the norm's reach ``x`` as their sum, as autograd adds
    them for the reference (whose second output is ``x`` itself); ``x`` is then used once, by
    the op: downstream, the stream goes through a residual add."""
    torch.manual_seed(5)
    shape = (3, 4, 72)
    x, w, a = torch.randn(shape), torch.randn(shape[-1]), torch.randn(shape)
    dy, dz = torch.randn(shape), torch.randn(shape)
    fused_in, ref_in = _leaves(x, w), _leaves(x, w)
    outs = []
    for fn, (xi, wi) in ((rms_norm_with_residual, fused_in), (reference.rms_norm_with_residual, ref_in)):
        y, stream = fn(xi, wi, 1e-6)
        outs.append((y, stream))
        loss = (y * dy).sum() + (((stream + a) * dz).sum() if use_residual else 0.0)
        loss.backward()
    (y, stream), (y_ref, stream_ref) = outs
    torch.testing.assert_close(y, y_ref, **TIGHT)
    assert torch.equal(stream, x) and stream.data_ptr() == fused_in[0].data_ptr()
    for got, want in zip(fused_in, ref_in):
        torch.testing.assert_close(got.grad, want.grad, **TIGHT)


def test_add_rms_norm_bf16_inputs_share_one_gradient():
    """Both inputs of one dtype get the sum's gradient from one write, equal to the reference's."""
    torch.manual_seed(6)
    x, r = torch.randn(6, 48, dtype=torch.bfloat16), torch.randn(6, 48, dtype=torch.bfloat16)
    w, dy = torch.randn(48, dtype=torch.bfloat16), torch.randn(6, 48, dtype=torch.bfloat16)
    fused_in, ref_in = _leaves(x, r), _leaves(x, r)
    add_rms_norm(*fused_in, w)[0].backward(dy)
    reference.add_rms_norm(*ref_in, w)[0].backward(dy)
    assert torch.equal(fused_in[0].grad, fused_in[1].grad)
    # the leaves' gradients do not alias: a second backward accumulates into each on its own
    add_rms_norm(*fused_in, w)[0].backward(dy)
    reference.add_rms_norm(*ref_in, w)[0].backward(dy)
    for got, want in zip(fused_in, ref_in):
        torch.testing.assert_close(got.grad, want.grad, rtol=2e-2, atol=2e-2)


def test_add_rms_norm_only_residual_needs_grad():
    torch.manual_seed(3)
    x, r, w = torch.randn(5, 33), torch.randn(5, 33), torch.randn(33)
    dy = torch.randn(5, 33)
    (rf,) = _leaves(r)
    (rr,) = _leaves(r)
    add_rms_norm(x, rf, w)[0].backward(dy)
    reference.add_rms_norm(x, rr, w)[0].backward(dy)
    torch.testing.assert_close(rf.grad, rr.grad, **TIGHT)


def test_rms_norm_bf16_close_to_reference():
    torch.manual_seed(4)
    x = torch.randn(9, 80, dtype=torch.bfloat16)
    w = torch.randn(80, dtype=torch.bfloat16)
    dy = torch.randn(9, 80, dtype=torch.bfloat16)
    xf, wf = _leaves(x, w)
    xr, wr = _leaves(x, w)
    y = rms_norm(xf, wf)
    y.backward(dy)
    reference.rms_norm(xr, wr).backward(dy)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference.rms_norm(x, w), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(xf.grad, xr.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(wf.grad.float(), wr.grad.float(), rtol=2e-2, atol=1e-1)


def test_rms_norm_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight size 8"):
        rms_norm(torch.randn(2, 6), torch.randn(8))
