"""The feed-forward's peak memory through a forward and backward against diffusers' ``FeedForward``
(what its training step runs), eager and compiled, in bf16 at a shape where the hidden activation
``[tokens, ffn_dim]`` outweighs everything else, as it does in Wan's blocks (8960 x 32760 tokens)."""

import pytest
import torch
from allocation_peak import peak_bytes
from diffusers.models.attention import FeedForward

from loongforge.diffusion.ops.feed_forward import feed_forward_kernels, gelu_feed_forward

TOKENS, WIDTH, FFN = 512, 64, 1024


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.long)])
def test_forward_backward_peak_no_more_than_diffusers(compiled):
    """The backward recomputes ``gelu(h)`` for the down-projection's weight gradient and frees it,
    then turns the GELU output's gradient into ``dh`` in place (``gelu_tanh_backward_in_place``):
    less live at once than autograd keeps for diffusers' module (``h``,
    ``gelu(h)``, then ``h``, ``dg``, ``dh``), eager and compiled (inductor runs the op in place),
    where writing ``dh`` and ``gelu(h)`` beside ``dg`` kept about 1.7 ``[tokens, ffn_dim]`` more."""
    torch.manual_seed(0)
    ff = FeedForward(WIDTH, inner_dim=FFN, activation_fn="gelu-approximate").to(torch.bfloat16)
    up, down = ff.net[0].proj, ff.net[2]
    x = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16)
    kernels = feed_forward_kernels(False)

    def ours_forward(x):
        return gelu_feed_forward(x, up.weight, up.bias, down.weight, down.bias, kernels)

    forwards = {"theirs": ff, "ours": ours_forward}
    if compiled:
        torch._dynamo.reset()
        forwards = {name: torch.compile(f, dynamic=False) for name, f in forwards.items()}
    results = {}
    for name, forward in forwards.items():
        def step(forward=forward):
            forward(x).backward(dy)

        step()  # (compiled here, and the first call's one-time allocations aside)
        for t in (x, *ff.parameters()):
            t.grad = None
        results[name] = peak_bytes(step), [t.grad.clone() for t in (x, *ff.parameters())]
        for t in (x, *ff.parameters()):
            t.grad = None
    hidden = TOKENS * FFN * 2
    (ours_peak, ours_grads), (theirs_peak, theirs_grads) = results["ours"], results["theirs"]
    assert theirs_peak >= 3 * hidden  # (what the count is there to see: h, gelu(h), dg at once)
    assert ours_peak <= theirs_peak, (ours_peak / hidden, theirs_peak / hidden)
    for got, want in zip(ours_grads, theirs_grads):  # for the same gradients (to bf16's precision:
        # ours sums the bias gradients in fp32, autograd in bf16)
        error = float((got.float() - want.float()).norm() / want.float().norm())
        assert error < 1e-2, error


def test_in_place_gelu_backward_equals_autograd():
    """``gelu_tanh_backward_in_place`` (the registry op's reference here): ``dg`` becomes the GELU's
    gradient, and the bias gradient is its column sum, as autograd's."""
    from loongforge.diffusion.ops.gelu import gelu_tanh_backward_in_place

    torch.manual_seed(1)
    h = torch.randn(3, 16, requires_grad=True)
    dg = torch.randn(3, 16)
    (want,) = torch.autograd.grad(torch.nn.functional.gelu(h, approximate="tanh"), h, dg)
    got = dg.clone()
    db = gelu_tanh_backward_in_place(got, h.detach())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(db, want.sum(0), rtol=1e-5, atol=1e-6)


def test_feed_forward_over_no_token():
    """A feed-forward over no token (an empty pack's share) returns an empty output and zero
    gradients, as diffusers' module does, without calling the GELU backward on empty matrices."""
    torch.manual_seed(2)
    ff = FeedForward(16, inner_dim=32, activation_fn="gelu-approximate")
    up, down = ff.net[0].proj, ff.net[2]
    x = torch.randn(0, 16, requires_grad=True)
    y = gelu_feed_forward(x, up.weight, up.bias, down.weight, down.bias, feed_forward_kernels(False))
    assert y.shape == (0, 16)
    y.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in ff.parameters())
