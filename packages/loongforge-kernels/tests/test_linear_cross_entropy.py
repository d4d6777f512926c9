"""Fused linear_cross_entropy vs the torch reference (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels import reference
from loongforge.kernels.linear_cross_entropy import linear_cross_entropy, token_chunk

TIGHT = dict(rtol=1e-5, atol=1e-5)


def _inputs(n, h, v, ignore_index, n_ignored, dtype=torch.float32, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[:n_ignored]] = ignore_index
    return hidden, weight, labels


def _run(fn, hidden, weight, labels, ignore_index, dloss, need_weight=True):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(need_weight)
    loss = fn(h, w, labels, ignore_index)
    loss.backward(dloss)
    return loss, h.grad, w.grad


@pytest.mark.parametrize(("ignore_index", "n_ignored"), [(-100, 6), (0, 3), (-100, 0)])
def test_linear_cross_entropy_per_token_grads_fp32(ignore_index, n_ignored):
    n, h, v = 37, 24, 301
    assert token_chunk(n, v, h) < n  # several token chunks, the last one partial
    hidden, weight, labels = _inputs(n, h, v, ignore_index, n_ignored)
    dloss = torch.rand(n) + 0.5  # per-token weights: catches a dweight that assumes a uniform grad
    loss, dh, dw = _run(linear_cross_entropy, hidden, weight, labels, ignore_index, dloss)
    loss_ref, dh_ref, dw_ref = _run(reference.linear_cross_entropy, hidden, weight, labels, ignore_index, dloss)
    assert loss.dtype == torch.float32 and loss.shape == (n,)
    torch.testing.assert_close(loss, loss_ref, **TIGHT)
    assert torch.all(loss[labels == ignore_index] == 0)
    torch.testing.assert_close(dh, dh_ref, **TIGHT)
    torch.testing.assert_close(dw, dw_ref, **TIGHT)


def test_linear_cross_entropy_mean_loss_frozen_weight():
    n, h, v = 20, 40, 129
    hidden, weight, labels = _inputs(n, h, v, -100, 4, seed=1)
    mask = labels != -100

    def mean_loss(fn):
        x = hidden.clone().requires_grad_(True)
        value = fn(x, weight, labels, -100).sum() / mask.sum()  # sum(): a stride-0 grad reaches the op
        value.backward()
        return value, x.grad

    value, dh = mean_loss(linear_cross_entropy)
    value_ref, dh_ref = mean_loss(reference.linear_cross_entropy)
    torch.testing.assert_close(value, value_ref, **TIGHT)
    torch.testing.assert_close(dh, dh_ref, **TIGHT)


def test_linear_cross_entropy_all_tokens_ignored():
    hidden, weight, labels = _inputs(6, 8, 50, -100, 6, seed=2)
    loss, dh, dw = _run(linear_cross_entropy, hidden, weight, labels, -100, torch.ones(6))
    assert torch.equal(loss, torch.zeros(6))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_linear_cross_entropy_bf16_close_to_reference():
    n, h, v = 16, 32, 97
    hidden, weight, labels = _inputs(n, h, v, -100, 2, dtype=torch.bfloat16, seed=3)
    dloss = torch.rand(n)
    loss, dh, dw = _run(linear_cross_entropy, hidden, weight, labels, -100, dloss)
    loss_ref, dh_ref, dw_ref = _run(reference.linear_cross_entropy, hidden, weight, labels, -100, dloss)
    assert dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, loss_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dh.float(), dh_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), dw_ref.float(), rtol=2e-2, atol=2e-2)


def test_linear_cross_entropy_rejects_out_of_range_label():
    hidden, weight, labels = _inputs(4, 8, 10, -100, 0, seed=4)
    labels[2] = 10
    with pytest.raises(ValueError, match="label 10 is outside"):
        linear_cross_entropy(hidden, weight, labels)
