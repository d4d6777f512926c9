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


def _chunked(budget_tokens: int, vocab: int):
    """The fused op with chunks of ``budget_tokens`` fp32 rows of logits."""
    def fn(hidden, weight, labels, ignore_index=-100):
        return linear_cross_entropy(hidden, weight, labels, ignore_index, chunk_bytes=budget_tokens * vocab * 4)

    return fn


def test_token_chunk_fits_the_logits_budget():
    assert token_chunk(8192, 128256, 2, 512 * 2**20) == 2048  # 2048 x 128256 bf16 logits: 501 MiB
    assert token_chunk(8192, 32000, 2, 512 * 2**20) == 8192
    assert token_chunk(100, 32000, 2, 512 * 2**20) == 100  # no more than the tokens
    assert token_chunk(37, 301, 4, 16 * 301 * 4) == 16


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize(("ignore_index", "n_ignored"), [(-100, 6), (0, 3), (-100, 0)])
def test_linear_cross_entropy_per_token_grads_fp32(ignore_index, n_ignored, uniform):
    n, h, v = 37, 24, 301
    fused = _chunked(16, v)  # three token chunks, the last one partial
    hidden, weight, labels = _inputs(n, h, v, ignore_index, n_ignored)
    # the gradient of a summed loss (every token the same factor: the weight gradient made in the forward,
    # scaled) or per-token weights (the backward detects them and recomputes the weight gradient)
    dloss = torch.full((n,), 0.37) if uniform else torch.rand(n) + 0.5
    loss, dh, dw = _run(fused, hidden, weight, labels, ignore_index, dloss)
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
    loss, dh, dw = _run(_chunked(4, v), hidden, weight, labels, -100, dloss)
    loss_ref, dh_ref, dw_ref = _run(reference.linear_cross_entropy, hidden, weight, labels, -100, dloss)
    assert dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, loss_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dh.float(), dh_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), dw_ref.float(), rtol=2e-2, atol=2e-2)


def test_linear_cross_entropy_masked_tokens_are_not_counted():
    """Tokens whose loss a mask leaves out (a zero factor) but whose label is counted: per-token
    factors for the weight gradient, the same numbers as the reference."""
    n, h, v = 29, 16, 83
    hidden, weight, labels = _inputs(n, h, v, -100, 3, seed=5)
    dloss = torch.ones(n)
    dloss[:7] = 0
    fused = _chunked(8, v)
    loss, dh, dw = _run(fused, hidden, weight, labels, -100, dloss)
    loss_ref, dh_ref, dw_ref = _run(reference.linear_cross_entropy, hidden, weight, labels, -100, dloss)
    torch.testing.assert_close(dh, dh_ref, **TIGHT)
    torch.testing.assert_close(dw, dw_ref, **TIGHT)


def test_linear_cross_entropy_backward_runs_once():
    hidden, weight, labels = _inputs(9, 8, 40, -100, 1, seed=6)
    loss = linear_cross_entropy(hidden.requires_grad_(True), weight.requires_grad_(True), labels)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.sum().backward()


def test_linear_cross_entropy_without_grad_mode_keeps_no_graph():
    hidden, weight, labels = _inputs(9, 8, 40, -100, 1, seed=7)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden.requires_grad_(True), weight.requires_grad_(True), labels)
    torch.testing.assert_close(loss, reference.linear_cross_entropy(hidden.detach(), weight.detach(), labels), **TIGHT)
    assert loss.grad_fn is None


def test_linear_cross_entropy_rejects_out_of_range_label():
    hidden, weight, labels = _inputs(4, 8, 10, -100, 0, seed=4)
    labels[2] = 10
    with pytest.raises(ValueError, match="label 10 is outside"):
        linear_cross_entropy(hidden, weight, labels)


def test_an_out_of_range_label_in_training_is_refused_at_the_backwards_read():
    """With a weight gradient to make, the forward reads nothing back: the label's loss is NaN (no
    out-of-bounds read) and the backward's one host read refuses it by value."""
    hidden, weight, labels = _inputs(4, 8, 10, -100, 0, seed=4)
    labels[1] = -7
    loss = linear_cross_entropy(hidden.requires_grad_(True), weight.requires_grad_(True), labels)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()
    with pytest.raises(ValueError, match="label -7 is outside"):
        loss.sum().backward()


def _uniform(budget_tokens: int, vocab: int):
    """The fused op promised a uniform gradient (``uniform_grad``: no host read in its backward)."""
    def fn(hidden, weight, labels, ignore_index=-100):
        return linear_cross_entropy(hidden, weight, labels, ignore_index, chunk_bytes=budget_tokens * vocab * 4,
                                    uniform_grad=True)

    return fn


@pytest.mark.parametrize("factor", [1.0, 0.37])
@pytest.mark.parametrize(("ignore_index", "n_ignored"), [(-100, 6), (0, 0)])
def test_a_promised_uniform_gradient_matches_the_reference_without_a_read(ignore_index, n_ignored, factor,
                                                                          monkeypatch):
    n, h, v = 37, 24, 301
    hidden, weight, labels = _inputs(n, h, v, ignore_index, n_ignored, seed=8)
    # the loss a task sums over its mask: uncounted tokens' factor is 0 (ignore_index), the rest share one
    dloss = torch.where(labels == ignore_index, 0.0, factor)

    def no_read(*_):
        raise AssertionError("the backward read a value back")

    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    monkeypatch.setattr(torch.Tensor, "item", no_read)
    loss, dh, dw = _run(_uniform(16, v), hidden, weight, labels, ignore_index, dloss)
    monkeypatch.undo()
    loss_ref, dh_ref, dw_ref = _run(reference.linear_cross_entropy, hidden, weight, labels, ignore_index, dloss)
    torch.testing.assert_close(loss, loss_ref, **TIGHT)
    torch.testing.assert_close(dh, dh_ref, **TIGHT)
    torch.testing.assert_close(dw, dw_ref, **TIGHT)


def test_a_broken_uniform_promise_gives_a_nan_weight_gradient_never_a_wrong_one():
    n, h, v = 29, 16, 83
    hidden, weight, labels = _inputs(n, h, v, -100, 3, seed=9)
    dloss = torch.ones(n)
    dloss[:7] = 0.5  # per-token weights on counted tokens
    loss, dh, dw = _run(_uniform(8, v), hidden, weight, labels, -100, dloss)
    _, dh_ref, _ = _run(reference.linear_cross_entropy, hidden, weight, labels, -100, dloss)
    torch.testing.assert_close(dh, dh_ref, **TIGHT)  # row by row: exact for any factor
    assert torch.isnan(dw).all()


def test_an_out_of_range_label_under_a_uniform_promise_is_a_nan_loss():
    hidden, weight, labels = _inputs(4, 8, 10, -100, 0, seed=4)
    labels[1] = 12
    loss = linear_cross_entropy(hidden.requires_grad_(True), weight.requires_grad_(True), labels, uniform_grad=True)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()
    loss.sum().backward()  # nothing read back: the NaN loss is what the loop sees and skips


def test_no_counted_token_under_a_uniform_promise_gives_zero_gradients():
    hidden, weight, labels = _inputs(6, 8, 50, -100, 6, seed=2)
    loss, dh, dw = _run(_uniform(4, 50), hidden, weight, labels, -100, torch.zeros(6))
    assert torch.equal(loss, torch.zeros(6))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))
