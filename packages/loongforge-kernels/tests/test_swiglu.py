"""Fused swiglu vs the torch reference (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels import reference
from loongforge.kernels.swiglu import BLOCK_COLS, swiglu, swiglu_backward

TIGHT = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(4, 3, 2 * 37), (3, 2 * (BLOCK_COLS + 75)), (2 * 1,)])
def test_swiglu_forward_backward_fp32(shape):
    torch.manual_seed(0)
    gate_up = torch.randn(shape) * 3
    dy = torch.randn(*shape[:-1], shape[-1] // 2)
    gf = gate_up.clone().requires_grad_(True)
    gr = gate_up.clone().requires_grad_(True)
    y = swiglu(gf)
    y_ref = reference.swiglu(gr)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, **TIGHT)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(gf.grad, gr.grad, **TIGHT)


def test_swiglu_non_contiguous_rows_bf16():
    torch.manual_seed(1)
    wide = torch.randn(5, 2 * 48 + 10, dtype=torch.bfloat16)
    gf = wide.clone().requires_grad_(True)
    gr = wide.clone().requires_grad_(True)
    dy = torch.randn(5, 48, dtype=torch.bfloat16)
    y = swiglu(gf[:, : 2 * 48])  # rows strided wider than the op's input
    y_ref = reference.swiglu(gr[:, : 2 * 48])
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(gf.grad, gr.grad, rtol=2e-2, atol=2e-2)


def test_swiglu_rejects_odd_last_dim():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_output", [True, False])
def test_swiglu_backward_recomputes_the_output_in_its_pass(with_output, dtype):
    """``swiglu_backward``: the gradient of ``gate_up`` and, on request, the output, as the reference
    (and as autograd through ``swiglu``)."""
    torch.manual_seed(2)
    shape = (3, 2, 2 * (BLOCK_COLS + 9))
    gate_up = (torch.randn(shape) * 3).to(dtype)
    dy = torch.randn(*shape[:-1], shape[-1] // 2).to(dtype)
    dgu, y = swiglu_backward(dy, gate_up, with_output)
    dgu_ref, y_ref = reference.swiglu_backward(dy, gate_up, with_output)
    tol = TIGHT if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert dgu.dtype == dtype and dgu.shape == gate_up.shape
    torch.testing.assert_close(dgu, dgu_ref, **tol)
    g = gate_up.float().requires_grad_(True)
    reference.swiglu(g).backward(dy.float())
    torch.testing.assert_close(dgu_ref.float(), g.grad, **(TIGHT if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))
    if with_output:
        assert y.shape == dy.shape
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(y, swiglu(gate_up), rtol=0, atol=0)  # the forward's numbers exactly
    else:
        assert y.numel() == 0 and y_ref.numel() == 0


def test_swiglu_backward_rejects_a_gradient_of_another_shape():
    with pytest.raises(ValueError, match="does not match"):
        swiglu_backward(torch.randn(2, 5), torch.randn(2, 8), True)
