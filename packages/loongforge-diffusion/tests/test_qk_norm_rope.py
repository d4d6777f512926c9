"""The query/key norm + RoPE contracts (loongforge-diffusion's torch references) and the autograd
function over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from compiled_vs_composed import assert_compiled_like_composed

from loongforge.core.kernels import get_kernel_with_backward
from loongforge.diffusion.ops import qk_norm_rope as ref
from loongforge.diffusion.ops.attention_inputs import normed_rotated_qkv

EPS = 1e-6
TOKENS, HEADS, HEAD_DIM = 23, 3, 8
WIDTH = HEADS * HEAD_DIM


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(TOKENS, 3 * WIDTH, generator=g) * 2).to(dtype)
    wq, wk = (1 + 0.5 * torch.randn(WIDTH, generator=g) for _ in range(2))
    angles = torch.rand(TOKENS, HEAD_DIM // 2, generator=g) * 40
    return qkv, wq, wk, angles.cos(), angles.sin()


def _composed(qkv, wq, wk, cos, sin):
    """diffusers' Wan attention inputs: RMSNorm across heads, then interleaved RoPE (the complex
    product of channel pairs), in fp32 with the norm's output rounded to the input dtype."""
    out = []
    for i, w in enumerate((wq, wk)):
        x = qkv[:, i * WIDTH : (i + 1) * WIDTH]
        y = F.rms_norm(x.float(), (WIDTH,), w, EPS).to(qkv.dtype).float()
        pairs = torch.view_as_complex(y.unflatten(1, (HEADS, HEAD_DIM // 2, 2)))
        rotated = pairs * torch.complex(cos, sin)[:, None]
        out.append(torch.view_as_real(rotated).flatten(1).to(qkv.dtype))
    return out[0], out[1], qkv[:, 2 * WIDTH :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_forward_and_backward_equal_autograd_of_the_ops(dtype):
    qkv, wq, wk, cos, sin = _inputs(dtype)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(TOKENS, WIDTH, generator=g).to(dtype) for _ in range(3)]
    leaves = [t.clone().requires_grad_() for t in (qkv, wq, wk)]
    outputs = _composed(*leaves, cos, sin)
    torch.autograd.backward(outputs, grads)

    q, k = ref.qk_norm_rope(qkv, wq, wk, cos, sin, EPS)
    dqkv, dweights = ref.qk_norm_rope_backward(*grads, qkv, wq, wk, cos, sin, EPS)
    # fp32: rounding of the complex product; bf16: one rounding step of the output
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(q, outputs[0], **tol)
    torch.testing.assert_close(k, outputs[1], **tol)
    torch.testing.assert_close(dqkv, leaves[0].grad, **tol)
    wtol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.5, "rtol": 1e-2}
    torch.testing.assert_close(dweights, torch.stack((leaves[1].grad, leaves[2].grad)), **wtol)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_function_gradients_equal_autograd_compiled_or_not(backend):
    """``normed_rotated_qkv`` (reference ops) inside a graph that also uses the values: the same
    outputs and gradients as autograd of the composed ops, compiled or not. A reference that
    returned views of its intermediates lost the query/key gradients in compiled graphs."""
    x = torch.randn(TOKENS, 16, generator=torch.Generator().manual_seed(2))
    proj = torch.randn(16, 3 * WIDTH, generator=torch.Generator().manual_seed(3)) / 4
    _, wq, wk, cos, sin = _inputs()
    kernels = get_kernel_with_backward("qk_norm_rope", force_reference=True)

    def loss(attention_inputs, x, proj, wq, wk):
        q, k, v = attention_inputs(x @ proj, wq, wk)
        return (q * k.sin()).sum() + (v.cos() * q).sum()

    def fused(qkv, wq, wk):
        return normed_rotated_qkv(qkv, wq, wk, cos, sin, EPS, kernels)

    def composed(qkv, wq, wk):
        return _composed(qkv, wq, wk, cos, sin)

    assert_compiled_like_composed(loss, composed, fused, [x, proj, wq, wk], backend)


@pytest.mark.parametrize("change, match", [
    (lambda a: (a[0][:, 1:], *a[1:]), r"qkv must be \[tokens, 3 \* width\]"),
    (lambda a: (a[0], a[1], a[2][:-1], *a[3:]), r"k_weight must be \[24\]"),
    (lambda a: (*a[:3], *(torch.cat((t, t[:, :1]), 1) for t in a[3:])), r"head_dim 2 \* 5 \(from cos \(23, 5\)\) does not divide the width 24"),
    (lambda a: (*a[:3], a[3], a[4][:-1]), r"cos and sin must both be \[tokens=23, head_dim / 2\]"),
])
def test_bad_inputs_name_what_is_wrong(change, match):
    with pytest.raises(ValueError, match=match):
        ref.qk_norm_rope(*change(_inputs()), EPS)
