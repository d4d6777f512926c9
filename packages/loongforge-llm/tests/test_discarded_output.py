"""``DiscardedOutput``: the freed output is recomputed for the backward, gradients equal keeping it."""

import torch

from loongforge.llm.layers.discarded_output import DiscardedOutput


def _chain(x, w1, w2, discard: bool):
    h = x @ w1
    if discard:
        act = DiscardedOutput()
        y = act.run(torch.nn.functional.silu, h)
        z = y @ w2  # saves y for its backward
        act.discard(z)
        freed = y.untyped_storage().nbytes()
    else:
        z = torch.nn.functional.silu(h) @ w2
        freed = None
    return z, freed


def test_gradients_equal_keeping_the_output_and_storage_is_freed():
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    grads = []
    for discard in (False, True):
        for t in (x, w1, w2):
            t.grad = None
        z, freed = _chain(x, w1, w2, discard)
        if discard:
            assert freed == 0  # the activation's memory is released after the forward
        (z.square().sum()).backward()
        grads.append([t.grad.clone() for t in (x, w1, w2)])
    for kept, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, kept, rtol=0, atol=0)


def test_a_strided_output_is_refilled_in_place():
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)

    def fn(t):  # a transposed (non-contiguous) output
        return (t * 2).t()[:3, :]

    for discard in (False, True):
        x.grad = w.grad = None
        if discard:
            d = DiscardedOutput()
            y = d.run(fn, x)
            z = y.t() @ w
            d.discard(z)
        else:
            z = fn(x).t() @ w
        z.sum().backward()
        if discard:
            torch.testing.assert_close((x.grad.clone(), w.grad.clone()), ref, rtol=0, atol=0)
        else:
            ref = (x.grad.clone(), w.grad.clone())


def test_without_a_backward_the_output_is_kept():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    with torch.no_grad():
        d = DiscardedOutput()
        y = d.run(torch.tanh, x)
        z = y @ w
        d.discard(z)
    torch.testing.assert_close(y, torch.tanh(x).detach(), rtol=0, atol=0)
    torch.testing.assert_close(z, torch.tanh(x).detach() @ w.detach(), rtol=0, atol=0)
