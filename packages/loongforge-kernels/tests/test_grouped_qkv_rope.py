"""Fused grouped_qkv_rope vs its torch reference (Triton interpreter on CPU; the GPU with
TRITON_INTERPRET=0): outputs, the gradient of the whole qkv row from strided output gradients,
partial rotary and an output without a gradient."""

from __future__ import annotations

import pytest
import torch

from loongforge.kernels.grouped_qkv_rope import grouped_qkv_rope
from loongforge.llm.ops.grouped_qkv_rope import grouped_qkv_rope as reference

TIGHT = dict(rtol=1e-5, atol=1e-5)


def _tables(s: int, b: int, rot: int):
    positions = torch.arange(s, dtype=torch.float32)[:, None].expand(s, b) + torch.arange(b)[None, :] * 3
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    angles = positions[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def _run(fn, qkv, cos, sin, grads):
    x = qkv.clone().requires_grad_(True)
    outs = fn(x, cos, sin)
    torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None], [g for g in grads if g is not None])
    return outs, x.grad


@pytest.mark.parametrize(("groups", "per_group", "head_dim", "rot"), [(2, 3, 16, 16), (4, 1, 8, 8), (1, 2, 12, 8)])
def test_matches_the_reference(groups, per_group, head_dim, rot):
    s, b = 5, 3
    torch.manual_seed(0)
    # a view of a [s, b, groups * (per_group + 2) * head_dim] projection output, as the attention hands it
    qkv = torch.randn(s, b, groups * (per_group + 2) * head_dim).view(s, b, groups, per_group + 2, head_dim)
    cos, sin = _tables(s, b, rot)
    # output gradients in the layouts attention's backward may hand back: [b, s, heads, d] memory order
    grads = [torch.randn(b, s, groups * per_group, head_dim).transpose(0, 1),
             torch.randn(s, b, groups, head_dim), torch.randn(s, b, groups, head_dim)]
    got, dgot = _run(grouped_qkv_rope, qkv, cos, sin, grads)
    want, dwant = _run(reference, qkv, cos, sin, grads)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, **TIGHT)
    torch.testing.assert_close(dgot, dwant, **TIGHT)


def test_output_without_gradient_and_bf16():
    s, b, groups, per_group, d = 4, 2, 2, 2, 16
    torch.manual_seed(1)
    qkv = torch.randn(s, b, groups, per_group + 2, d).to(torch.bfloat16)
    cos, sin = _tables(s, b, d)
    grads = [torch.randn(s, b, groups * per_group, d).to(torch.bfloat16), None,
             torch.randn(s, b, groups, d).to(torch.bfloat16)]
    got, dgot = _run(grouped_qkv_rope, qkv, cos, sin, grads)
    want, dwant = _run(reference, qkv, cos, sin, grads)
    assert all(g.dtype == torch.bfloat16 for g in got) and dgot.dtype == torch.bfloat16
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dgot.float(), dwant.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(dgot[..., per_group, :], torch.zeros_like(dgot[..., per_group, :]))  # no key gradient


def test_bad_shapes_name_the_op():
    qkv = torch.randn(3, 1, 2, 4, 8)
    cos, sin = _tables(3, 1, 8)
    with pytest.raises(ValueError, match="grouped_qkv_rope: expected"):
        grouped_qkv_rope(qkv, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="even rot_dim"):
        grouped_qkv_rope(qkv, cos[..., :3], sin[..., :3])


def _run_norm(fn, qkv, cos, sin, qw, kw, grads):
    x = qkv.clone().requires_grad_(True)
    wq, wk = qw.clone().requires_grad_(True), kw.clone().requires_grad_(True)
    outs = fn(x, cos, sin, wq, wk, 1e-6)
    torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None], [g for g in grads if g is not None])
    return outs, (x.grad, wq.grad, wk.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("groups", "per_group", "head_dim", "rot"), [(2, 3, 16, 16), (1, 2, 12, 8)])
def test_the_normalised_form_matches_the_reference(groups, per_group, head_dim, rot, dtype):
    """``grouped_qkv_norm_rope`` (Qwen3's per-head q/k RMSNorm, then RoPE): outputs, the qkv row's
    gradient and both norm weights' gradients against the separate norm and RoPE references."""
    from loongforge.kernels.grouped_qkv_rope import grouped_qkv_norm_rope
    from loongforge.llm.ops.grouped_qkv_rope import grouped_qkv_norm_rope as norm_reference

    s, b = 5, 3
    torch.manual_seed(1)
    qkv = (torch.randn(s, b, groups * (per_group + 2) * head_dim) * 2).to(dtype)
    qkv = qkv.view(s, b, groups, per_group + 2, head_dim)
    cos, sin = _tables(s, b, rot)
    qw, kw = (torch.rand(head_dim) + 0.5).to(dtype), (torch.rand(head_dim) + 0.5).to(dtype)
    grads = [torch.randn(b, s, groups * per_group, head_dim).transpose(0, 1).to(dtype),
             torch.randn(s, b, groups, head_dim).to(dtype), torch.randn(s, b, groups, head_dim).to(dtype)]
    got, dgot = _run_norm(grouped_qkv_norm_rope, qkv, cos, sin, qw, kw, grads)
    want, dwant = _run_norm(norm_reference, qkv, cos, sin, qw, kw, grads)
    tol = TIGHT if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        torch.testing.assert_close(g, w, **tol)
    for g, w in zip(dgot, dwant):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **(tol if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)))


def test_the_normalised_form_without_a_query_gradient():
    from loongforge.kernels.grouped_qkv_rope import grouped_qkv_norm_rope
    from loongforge.llm.ops.grouped_qkv_rope import grouped_qkv_norm_rope as norm_reference

    torch.manual_seed(2)
    qkv = torch.randn(4, 2, 2, 4, 8)
    cos, sin = _tables(4, 2, 8)
    qw, kw = torch.rand(8) + 0.5, torch.rand(8) + 0.5
    grads = [None, torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8)]
    _, dgot = _run_norm(grouped_qkv_norm_rope, qkv, cos, sin, qw, kw, grads)
    _, dwant = _run_norm(norm_reference, qkv, cos, sin, qw, kw, grads)
    torch.testing.assert_close(dgot[0], dwant[0], **TIGHT)  # the qkv row
    torch.testing.assert_close(dgot[2], dwant[2], **TIGHT)  # the key norm's weight
    assert dwant[1] is None and torch.count_nonzero(dgot[1]) == 0  # no query gradient: none for its weight
