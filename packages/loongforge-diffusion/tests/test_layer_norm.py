"""adaLN's LayerNorm contracts (torch references) and the autograd function over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compiled_vs_composed import assert_compiled_like_composed

from loongforge.core.kernels import get_kernel_with_backward
from loongforge.diffusion.ops import layer_norm as ref
from loongforge.diffusion.ops.modulated_norm import normalize_and_modulate

EPS = 1e-6
TOKENS, WIDTH = 19, 24


def _inputs(samples: int, dtype=torch.float32, seed=0):
    """x, a transform of ``samples`` rows and the sample of each token (None for one sample)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(TOKENS, WIDTH, generator=g) * 3 + 1).to(dtype)
    weight = 1 + 0.3 * torch.randn(samples, WIDTH, generator=g)
    bias = torch.randn(samples, WIDTH, generator=g)
    index = None if samples == 1 else torch.arange(TOKENS) * samples // TOKENS
    return x, weight, bias, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("samples", [1, 3])
def test_reference_equals_autograd_of_layer_norm_then_transform(dtype, samples):
    """diffusers' ``(FP32LayerNorm(x.float()) * (1 + scale) + shift).type_as(x)`` under autograd,
    with the modulation gathered per token in a pack."""
    x, weight, bias, index = _inputs(samples, dtype)
    dy = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(1)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    per_token = (lambda t: t) if index is None else (lambda t: t[index])
    y = (F.layer_norm(leaves[0].float(), (WIDTH,), eps=EPS) * per_token(leaves[1]) + per_token(leaves[2])).to(dtype)
    y.backward(dy)
    got = ref.modulated_layer_norm(x, weight, bias, EPS, index)
    dx, dweight, dbias = ref.modulated_layer_norm_backward(dy, x, weight, bias, EPS, index)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(got, y, **tol)
    torch.testing.assert_close(dx, leaves[0].grad, **tol)
    assert dweight.shape == dbias.shape == (samples, WIDTH) and dweight.dtype == dbias.dtype == torch.float32
    torch.testing.assert_close(dweight, leaves[1].grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(dbias, leaves[2].grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("samples", [1, 2])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_function_gradients_equal_autograd_compiled_or_not(backend, samples):
    """``normalize_and_modulate`` (reference ops) as a block uses it: modulation ``1 + scale`` and
    ``shift`` from one table per sample, then a second norm with its own parameters; the same
    value and gradients as autograd of the composed ops, compiled or not. A reference whose
    output was the input of a no-op ``.to`` lost every gradient in compiled graphs."""
    x, _, _, index = _inputs(samples)
    table = torch.randn(samples, 2, WIDTH, generator=torch.Generator().manual_seed(2))
    norm_w, norm_b = _inputs(1, seed=3)[1:3]
    kernels = get_kernel_with_backward("modulated_layer_norm", force_reference=True)

    def composed(x, weight, bias, index):
        if index is not None:
            weight, bias = weight[index], bias[index]
        return F.layer_norm(x.float(), (WIDTH,), eps=EPS) * weight + bias

    def fused(x, weight, bias, index):
        return normalize_and_modulate(x, weight, bias, EPS, kernels, index)

    def loss(norm, x, table, norm_w, norm_b):
        shift, scale = table.unbind(1)
        h = norm(x, 1 + scale, shift, index)
        return (norm(h.sin(), norm_w[0][None], norm_b[0][None], None) * h).sum()

    assert_compiled_like_composed(loss, composed, fused, [x, table, norm_w, norm_b], backend)


@pytest.mark.parametrize("change, match", [
    (lambda x, w, b, i: (x[0], w, b, i), r"x must be \[tokens, width\]"),
    (lambda x, w, b, i: (x, w[:, :-1], b, i), r"weight and bias must both be \[rows, 24\]"),
    (lambda x, w, b, i: (x, w, b, None), "a transform of 3 rows needs an index"),
    (lambda x, w, b, i: (x, w, b, i.int()), r"index must be int64 \[tokens=19\]"),
])
def test_bad_inputs_name_what_is_wrong(change, match):
    x, w, b, index = change(*_inputs(3))
    with pytest.raises(ValueError, match=match):
        ref.modulated_layer_norm(x, w, b, EPS, index)
