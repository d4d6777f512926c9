"""The compiled kernels on a CUDA GPU at the shapes of a ~0.5B Llama step (16384 tokens, hidden
2048, 16/4 heads of 128, FFN 5632, vocab 32000), bf16, vs the torch reference on the same inputs
upcast to fp32: relative error ||got - ref|| / ||ref|| under 1e-2 for outputs and gradients.
Run with ``TRITON_INTERPRET=0`` on a GPU machine; skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from loongforge.core.kernels import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available(),
                       reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)"),
]

TOKENS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB = 16384, 2048, 16, 4, 128, 5632, 32000
BF16_REL = 1e-2


def _rel(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _compare(fused, ref_fn, inputs, grad_out):
    """Outputs and input grads of ``fused`` (bf16) vs ``ref_fn`` on the inputs upcast to fp32."""
    ours = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    refs = [t.detach().float().requires_grad_(True) if t.is_floating_point() else t for t in inputs]
    out, out_ref = fused(*ours), ref_fn(*refs)
    outs, outs_ref = (out, out_ref) if isinstance(out, tuple) else ((out,), (out_ref,))
    grads = grad_out if isinstance(grad_out, tuple) else (grad_out,)
    for o, r in zip(outs, outs_ref):
        assert o.dtype == torch.bfloat16 or o.dtype == r.dtype
        assert _rel(o, r) < BF16_REL
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(outs_ref, tuple(g.float() for g in grads))
    for o, r in zip(ours, refs):
        if o.requires_grad:
            assert torch.isfinite(o.grad).all()
            assert _rel(o.grad, r.grad) < BF16_REL, (tuple(o.shape), _rel(o.grad, r.grad))


def test_rms_norm_and_add_rms_norm_at_model_shape():
    from loongforge.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_with_residual

    torch.manual_seed(0)
    x, r = (torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16) for _ in range(2))
    w = 1 + 0.1 * torch.randn(HIDDEN, dtype=torch.bfloat16)
    _compare(lambda a, b: rms_norm(a, b, 1e-5), lambda a, b: reference.rms_norm(a, b, 1e-5), [x, w],
             torch.randn_like(x))
    _compare(lambda a, b, c: add_rms_norm(a, b, c, 1e-5), lambda a, b, c: reference.add_rms_norm(a, b, c, 1e-5),
             [x, r, w], (torch.randn_like(x), torch.randn_like(x)))
    _compare(lambda a, b: rms_norm_with_residual(a, b, 1e-5),
             lambda a, b: reference.rms_norm_with_residual(a, b, 1e-5), [x, w],
             (torch.randn_like(x), torch.randn_like(x)))


def test_rope_on_queries_read_from_the_qkv_projection():
    from loongforge.kernels.rope import rope

    torch.manual_seed(1)
    per_group = HEADS // GROUPS
    seq, batch = 4096, TOKENS // 4096
    qkv = torch.randn(seq, batch, GROUPS, per_group + 2, HEAD_DIM, dtype=torch.bfloat16)
    angles = torch.arange(seq, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angles = torch.cat([angles, angles], -1)[:, None, None].expand(seq, batch, GROUPS, HEAD_DIM).contiguous()
    cos, sin = angles.cos(), angles.sin()
    query = qkv[..., :per_group, :]  # a strided view, as the fast attention passes it
    _compare(lambda q: rope(q, cos, sin), lambda q: reference.rope(q, cos, sin), [query], torch.randn(query.shape, dtype=torch.bfloat16))


def test_swiglu_at_model_shape():
    from loongforge.kernels.swiglu import swiglu

    torch.manual_seed(2)
    gate_up = torch.randn(TOKENS, 2 * FFN, dtype=torch.bfloat16)
    _compare(swiglu, reference.swiglu, [gate_up], torch.randn(TOKENS, FFN, dtype=torch.bfloat16))


@pytest.mark.parametrize(("tokens", "vocab"), [(TOKENS, VOCAB), (8192, 128256)])
@pytest.mark.parametrize("uniform", [True, False])
def test_linear_cross_entropy_at_model_shape(tokens, vocab, uniform):
    """A summed loss (one gradient factor: the gradients made in the forward) and per-token
    factors (the weight gradient recomputed), at a 32K and a 128K vocab (several token chunks)."""
    from loongforge.kernels.linear_cross_entropy import linear_cross_entropy

    torch.manual_seed(3)
    hidden = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, HIDDEN) / HIDDEN**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,))
    labels[::7] = -100
    dloss = torch.full((tokens,), 1.0 / tokens) if uniform else torch.rand(tokens)
    _compare(lambda h, w: linear_cross_entropy(h, w, labels, chunk_bytes=256 * 2**20),
             lambda h, w: reference.linear_cross_entropy(h, w, labels), [hidden, weight], dloss)
