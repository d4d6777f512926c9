"""adaLN's LayerNorm contracts (torch references) and the autograd function over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongforge.core.kernels import layer_norm as ref
from loongforge.core.kernels.modulated_norm import layer_norm_kernels, normalize_and_modulate

EPS = 1e-6
TOKENS, WIDTH = 19, 24


def _inputs(rows: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(TOKENS, WIDTH, generator=g) * 3 + 1).to(dtype)
    weight = 1 + 0.3 * torch.randn(rows, WIDTH, generator=g)
    bias = torch.randn(rows, WIDTH, generator=g)
    return x, weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, TOKENS], ids=["shared", "per-token"])
def test_reference_equals_autograd_of_layer_norm_then_transform(dtype, rows):
    """diffusers' ``(FP32LayerNorm(x.float()) * (1 + scale) + shift).type_as(x)`` under autograd."""
    x, weight, bias = _inputs(rows, dtype)
    dy = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(1)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = (F.layer_norm(leaves[0].float(), (WIDTH,), eps=EPS) * leaves[1] + leaves[2]).to(dtype)
    y.backward(dy)
    got = ref.modulated_layer_norm(x, weight, bias, EPS)
    dx, dweight, dbias = ref.modulated_layer_norm_backward(dy, x, weight, bias, EPS)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(got, y, **tol)
    torch.testing.assert_close(dx, leaves[0].grad, **tol)
    assert dweight.shape == dbias.shape == (rows, WIDTH) and dweight.dtype == dbias.dtype == torch.float32
    torch.testing.assert_close(dweight, leaves[1].grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dbias, leaves[2].grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_function_gradients_equal_autograd_compiled_or_not(backend):
    """``normalize_and_modulate`` (reference ops) as a block uses it: modulation ``1 + scale`` and
    ``shift`` from one table, then a second norm with its own parameters; the same value and
    gradients as autograd of the composed ops, compiled or not. A reference whose output was the
    input of a no-op ``.to`` lost every gradient in compiled graphs."""
    x, _, _ = _inputs(1)
    table = torch.randn(1, 2, WIDTH, generator=torch.Generator().manual_seed(2))
    norm_w, norm_b = _inputs(1, seed=3)[1:]
    kernels = layer_norm_kernels(force_reference=True)

    def composed(x, weight, bias):
        return F.layer_norm(x.float(), (WIDTH,), eps=EPS) * weight + bias

    def fused(x, weight, bias):
        return normalize_and_modulate(x, weight, bias, EPS, kernels)

    def loss(norm, x, table, norm_w, norm_b):
        shift, scale = table.unbind(1)
        h = norm(x, 1 + scale, shift)
        return (norm(h.sin(), norm_w[0][None], norm_b[0][None]) * h).sum()

    results = []
    for norm, compile_with in ((composed, None), (fused, backend)):
        leaves = [t.clone().requires_grad_() for t in (x, table, norm_w, norm_b)]
        fn = loss if compile_with in (None, "eager") else torch.compile(loss, backend=compile_with, fullgraph=True)
        torch._dynamo.reset()
        value = fn(norm, *leaves)
        value.backward()
        results.append((value.detach(), [t.grad for t in leaves]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-5)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("change, match", [
    (lambda x, w, b: (x[0], w, b), r"x must be \[tokens, width\]"),
    (lambda x, w, b: (x, w[:, :-1], b), r"weight must be \[1, 24\] or \[tokens=19, 24\]"),
    (lambda x, w, b: (x, w, b.expand(TOKENS, WIDTH)), "must both be shared or both per token"),
])
def test_bad_inputs_name_what_is_wrong(change, match):
    with pytest.raises(ValueError, match=match):
        ref.modulated_layer_norm(*change(*_inputs(1)), EPS)
