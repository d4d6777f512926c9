"""``DiscardedOutput``: the freed output is recomputed for the backward, gradients equal keeping it."""

import pytest
import torch

from loongforge.llm.layers.discarded_output import DiscardedOutput, TakesDiscardedInput


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


class _Consumer(TakesDiscardedInput):
    """A linear that takes its input over where it is offered (as the fast layer spec's linears do)."""

    def __init__(self, w):
        self.w = w
        self.took = None

    def __call__(self, y):
        discarded, self.discarded_input = self.discarded_input, None
        self.took = discarded is not None and discarded.claim(y)
        return _TakingLinear.apply(y, self.w, discarded if self.took else None)


class _TakingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, discarded):
        ctx.discarded = discarded
        ctx.save_for_backward(w, *(() if discarded is not None else (y,)))
        return y @ w

    @staticmethod
    def backward(ctx, dz):
        w, *kept = ctx.saved_tensors
        dy = dz @ w.t()  # the input gradient first (a fused backward recomputes y from it)
        y = ctx.discarded.recomputed_input(dy) if ctx.discarded is not None else kept[0]
        return dy, y.t() @ dz, None


def test_a_consumer_that_takes_the_output_over_saves_nothing_and_gets_the_same_gradients():
    torch.manual_seed(1)
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    z_ref, _ = _chain(x, w1, w2, discard=False)
    ref = torch.autograd.grad(z_ref.square().sum(), (x, w1, w2))
    consumer = _Consumer(w2)
    act = DiscardedOutput()
    y = act.run(torch.nn.functional.silu, x @ w1, consumer=consumer)
    assert consumer.discarded_input is act
    z = consumer(y)
    act.discard(z)
    assert consumer.took and consumer.discarded_input is None and act.output is None
    assert y.untyped_storage().nbytes() == 0  # freed after the forward
    got = torch.autograd.grad(z.square().sum(), (x, w1, w2))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert act.recomputed is None  # handed over once, then dropped


def test_an_offer_for_another_tensor_is_not_taken():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(8, 3, requires_grad=True)
    consumer = _Consumer(w)
    act = DiscardedOutput()
    y = act.run(torch.tanh, x, consumer=consumer)
    z = consumer(y * 1.0)  # a new tensor, not the output: the consumer saves it as usual
    act.discard(z)
    assert not consumer.took and consumer.discarded_input is None
    z.sum().backward()
    torch.testing.assert_close(x.grad, (1 - torch.tanh(x) ** 2) * w.sum(1), rtol=1e-6, atol=1e-6)


def test_a_fused_backward_recomputes_the_output_once_for_a_consumer_that_took_it():
    """``run(..., backward=...)``: the consumer's request (with the output's gradient) runs the fused
    backward once; the function is not run again, and the gradients are autograd's."""
    from loongforge.core.kernels import reference

    torch.manual_seed(3)
    x = torch.randn(6, 8, requires_grad=True)
    w1, w2 = torch.randn(8, 32, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    ref = torch.autograd.grad((reference.swiglu(x @ w1) @ w2).square().sum(), (x, w1, w2))
    calls = {"fn": 0, "backward": 0}

    def fn(gate_up):
        calls["fn"] += 1
        return reference.swiglu(gate_up)

    def backward(dy, gate_up):
        calls["backward"] += 1
        return reference.swiglu_backward(dy, gate_up, True)

    consumer = _Consumer(w2)
    act = DiscardedOutput()
    y = act.run(fn, x @ w1, consumer=consumer, backward=backward)
    z = consumer(y)
    act.discard(z)
    assert consumer.took and y.untyped_storage().nbytes() == 0
    got = torch.autograd.grad(z.square().sum(), (x, w1, w2))
    assert calls == {"fn": 1, "backward": 1}  # the forward once, then the fused backward alone
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_fused_backward_is_not_used_for_a_consumer_that_saved_the_output():
    torch.manual_seed(4)
    from loongforge.core.kernels import reference

    x = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    act = DiscardedOutput()
    y = act.run(reference.swiglu, x[:, :6], backward=lambda dy, gu: reference.swiglu_backward(dy, gu, True))
    z = y @ w
    act.discard(z)
    assert act.backward is None  # the saved output is refilled by the hook, as without one
    (gx,) = torch.autograd.grad(z.sum(), (x,))
    (gx_ref,) = torch.autograd.grad((reference.swiglu(x[:, :6]) @ w).sum(), (x,))
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("take_over", [True, False])
def test_hand_over_frees_an_output_made_with_its_graph_and_remakes_it_for_the_consumer(take_over):
    """``hand_over``: the residual add + norm runs with its own graph (its backward adds the sum's
    gradient inside the norm's), only the consumer's copy of the normed output is freed and made
    again without a graph; the gradients are those of the run that keeps it."""
    from loongforge.core.kernels import reference

    torch.manual_seed(5)
    a, r = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    w_norm, w = torch.rand(8, requires_grad=True), torch.randn(8, 3, requires_grad=True)

    def block(discard: bool):
        normed, total = reference.add_rms_norm(a, r, w_norm)
        consumer = _Consumer(w) if take_over else (lambda y: y @ w)
        if discard:
            remade = []
            d = DiscardedOutput()
            d.hand_over(normed, lambda t: remade.append(1) or reference.rms_norm(t, w_norm), total, consumer=consumer)
        z = consumer(normed)
        if discard:
            d.discard(z)
            assert normed.untyped_storage().nbytes() == 0
        out = (z.square().sum() + (total * 0.5).sum())
        grads = torch.autograd.grad(out, (a, r, w_norm, w))
        if discard:
            assert remade == [1]
        return grads

    for got, want in zip(block(True), block(False)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _doubled_into_matmul(normed, h, w, discard: bool):
    """``normed @ w`` for ``normed = h * 2``; with ``discard`` ``normed`` handed over (remade from ``h``)."""
    if discard:
        d = DiscardedOutput()
        d.hand_over(normed, lambda t: t * 2.0, h)
    z = normed @ w
    if discard:
        d.discard(z)
    return z


def test_hand_over_keeps_its_inputs_as_saved_activations():
    """What ``hand_over`` keeps for the recomputation goes through the saved-tensor hooks (as
    activation offload moves saved activations off the device): the layer's input is not held
    elsewhere, and the gradients are those of the run that keeps the output."""
    import weakref

    torch.manual_seed(6)
    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(8, 3, requires_grad=True)

    def block(discard: bool):
        h = x * 1.5  # the layer input (a non-leaf: nothing else keeps it)
        normed = h * 2.0  # an op that saves nothing
        packed = []

        def pack(t):
            packed.append(t.data_ptr())
            return t.clone()  # the hook's own copy, as offload's host copy

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            z = _doubled_into_matmul(normed, h, w, discard)
        alive, h_ptr = weakref.ref(h), h.data_ptr()
        del h
        if discard:
            assert alive() is None  # only the hook's copy of the input is left
            assert h_ptr in packed
        return torch.autograd.grad(z.square().sum(), (x, w))

    for got, want in zip(block(True), block(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_hand_over_of_inputs_that_need_no_grad():
    """``hand_over`` where the recomputation's input needs no gradient (only the consumer's weight
    does) still keeps it for the recomputation; the gradients are those of the run that keeps it."""
    torch.manual_seed(7)
    h, w = torch.randn(5, 4), torch.randn(4, 3, requires_grad=True)

    def block(discard: bool):
        normed = h * 2.0
        z = _doubled_into_matmul(normed, h, w, discard)
        if discard:
            assert normed.untyped_storage().nbytes() == 0
        return torch.autograd.grad(z.square().sum(), (w,))

    torch.testing.assert_close(block(True)[0], block(False)[0], rtol=0, atol=0)
