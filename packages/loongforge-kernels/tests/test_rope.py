"""Fused rope vs the torch reference (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels import reference
from loongforge.kernels.rope import rope

TIGHT = dict(rtol=1e-5, atol=1e-5)


def _tables(positions: torch.Tensor, rot: int, base: float = 10000.0):
    """Llama-style cos/sin rows ``[len(positions), rot]`` for the given token positions."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _check(x, cos, sin, grad_tables=False):
    dy = torch.randn(x.shape)
    xf = x.clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    tf = [t.clone().requires_grad_(grad_tables) for t in (cos, sin)]
    tr = [t.clone().requires_grad_(grad_tables) for t in (cos, sin)]
    y = rope(xf, *tf)
    y_ref = reference.rope(xr, *tr)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, **TIGHT)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(xf.grad, xr.grad, **TIGHT)
    if grad_tables:
        for got, want in zip(tf, tr):
            assert got.grad.shape == want.grad.shape
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-4)
    return y


@pytest.mark.parametrize(("head_dim", "rot"), [(16, 16), (24, 10), (12, 4)])
def test_rope_full_and_partial_rotary(head_dim, rot):
    torch.manual_seed(0)
    tokens, heads = 7, 3
    x = torch.randn(tokens, heads, head_dim)
    # random (not cos/sin-shaped) tables: the two halves differ, so a swapped half would show
    cos, sin = torch.randn(tokens, rot), torch.randn(tokens, rot)
    y = _check(x, cos, sin)
    torch.testing.assert_close(y[..., rot:], x[..., rot:], rtol=0, atol=0)


def test_rope_sbhd_with_tables_broadcast_over_batch_and_table_grads():
    torch.manual_seed(1)
    seq, batch, heads, head_dim, rot = 5, 2, 3, 8, 6
    x = torch.randn(seq, batch, heads, head_dim)
    cos, sin = torch.randn(seq, 1, rot), torch.randn(seq, 1, rot)
    _check(x, cos, sin, grad_tables=True)


def test_rope_bshd_with_tables_missing_batch_dim():
    torch.manual_seed(2)
    x = torch.randn(2, 5, 4, 8)
    cos, sin = _tables(torch.arange(5), 8)
    _check(x, cos, sin)


def test_rope_packed_thd_matches_per_sequence_reference():
    torch.manual_seed(3)
    lengths = [3, 5, 2]
    heads, head_dim, rot = 2, 10, 6
    positions = torch.cat([torch.arange(n) for n in lengths])
    x = torch.randn(sum(lengths), heads, head_dim)
    cos, sin = _tables(positions, rot)
    packed = _check(x, cos, sin)
    start = 0
    for n in lengths:  # each packed sequence rotates as if it were alone, from position 0
        c, s = _tables(torch.arange(n), rot)
        torch.testing.assert_close(packed[start : start + n], reference.rope(x[start : start + n], c, s), **TIGHT)
        start += n


def test_rope_non_contiguous_heads_view():
    torch.manual_seed(4)
    qkv = torch.randn(6, 3, 4, 16)  # [tokens, (q, k, v), heads, head_dim]
    cos, sin = _tables(torch.arange(6), 16)
    dy = torch.randn(6, 4, 16)
    fused_qkv, ref_qkv = qkv.clone().requires_grad_(True), qkv.clone().requires_grad_(True)
    q = fused_qkv[:, 0]
    assert not q.is_contiguous()
    y = rope(q, cos, sin)
    y_ref = reference.rope(ref_qkv[:, 0], cos, sin)
    torch.testing.assert_close(y, y_ref, **TIGHT)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(fused_qkv.grad, ref_qkv.grad, **TIGHT)


def test_rope_rejects_odd_rot_dim():
    with pytest.raises(ValueError, match="rot_dim 5"):
        rope(torch.randn(2, 1, 8), torch.randn(2, 5), torch.randn(2, 5))
