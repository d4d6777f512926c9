"""The DSA torch references (loongforge-llm's loongforge.llm.ops.dsa) against direct dense computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from loongforge.llm.ops import dsa

TIGHT = dict(rtol=1e-5, atol=1e-5)


def _inputs(b=2, s=12, h=3, d_v=16, d_rope=8, hi=2, di=8, extra_kv=0, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    n_kv = s + extra_kv
    q = torch.randn(b, s, h, d_v + d_rope, generator=g)
    kv = torch.randn(b, n_kv, d_v + d_rope, generator=g)
    q_idx = torch.randn(b, s, hi, di, generator=g)
    k_idx = torch.randn(b, n_kv, di, generator=g)
    w_idx = torch.rand(b, s, hi, generator=g) + 0.1
    return q, kv, q_idx, k_idx, w_idx


def _dense_causal_attention(q, kv, scale, d_v):
    """Causal attention with the one latent head broadcast to every query head (SDPA, math kernel)."""
    b, s, h, d = q.shape
    n_kv = kv.shape[1]
    k = kv[:, None].expand(b, h, n_kv, d)
    v = kv[:, None, :, :d_v].expand(b, h, n_kv, d_v)
    mask = torch.arange(n_kv)[None, :] <= torch.arange(s)[:, None] + (n_kv - s)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def _all_causal_indices(b, s, n_kv):
    """Every visible key of every query, -1 past the causal limit (what top-k gives with k = S_kv)."""
    cols = torch.arange(n_kv)[None, :].expand(s, n_kv)
    visible = cols <= torch.arange(s)[:, None] + (n_kv - s)
    return torch.where(visible, cols, -1).to(torch.int32)[None].expand(b, s, n_kv).contiguous()


@pytest.mark.parametrize("extra_kv", [0, 3])
def test_topk_with_k_equal_to_s_selects_every_causal_key(extra_kv):
    _, _, q_idx, k_idx, w_idx = _inputs(extra_kv=extra_kv)
    n_kv = k_idx.shape[1]
    idx = dsa.dsa_indexer_topk(q_idx, k_idx, w_idx, n_kv)
    assert idx.dtype == torch.int32 and idx.shape == (2, 12, n_kv)
    got = idx.sort(-1).values
    want = _all_causal_indices(2, 12, n_kv).sort(-1).values
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_topk_matches_brute_force_ranking():
    _, _, q_idx, k_idx, w_idx = _inputs(b=1, s=10, hi=3, di=4, extra_kv=2, seed=3)
    k_idx, q_idx[:, :, 0] = k_idx.abs(), q_idx[:, :, 0].abs()  # head 0 scores > 0: no ties at 0
    topk = 4
    idx = dsa.dsa_indexer_topk(q_idx, k_idx, w_idx, topk)
    for t in range(10):
        visible = range(t + 2 + 1)  # offset = 2
        score = {
            s: sum(float(w_idx[0, t, j]) * max(0.0, float(q_idx[0, t, j].double() @ k_idx[0, s].double())) for j in range(3))
            for s in visible
        }
        best = sorted(score, key=score.get, reverse=True)[:topk]
        best += [-1] * (topk - len(best))
        assert sorted(idx[0, t].tolist()) == sorted(best), t


def test_topk_pads_short_rows_with_minus_one():
    _, _, q_idx, k_idx, w_idx = _inputs(b=1, s=6)
    idx = dsa.dsa_indexer_topk(q_idx, k_idx, w_idx, 4)
    for t in range(6):
        row = idx[0, t].tolist()
        assert row.count(-1) == max(0, 4 - (t + 1))
        assert all(-1 <= i <= t for i in row)


@pytest.mark.parametrize("extra_kv", [0, 5])
def test_sparse_attention_with_every_key_equals_dense_causal_attention(extra_kv):
    q, kv, *_ = _inputs(extra_kv=extra_kv)
    d_v, scale = 16, 1 / math.sqrt(24)
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    q2, kv2 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    idx = _all_causal_indices(2, 12, kv.shape[1])
    out = dsa.sparse_mla_attention(q1, kv1, idx, scale, d_v)
    ref = _dense_causal_attention(q2, kv2, scale, d_v)
    torch.testing.assert_close(out, ref, **TIGHT)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout)
    torch.testing.assert_close(q1.grad, q2.grad, **TIGHT)
    torch.testing.assert_close(kv1.grad, kv2.grad, **TIGHT)


def test_sparse_attention_over_a_subset_masks_the_rest():
    """Selecting keys == dense attention with every unselected key masked out; empty rows give 0."""
    q, kv, *_ = _inputs(b=1, s=8, seed=5)
    d_v, scale = 16, 0.3
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    idx = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(8)])[None].to(torch.int32)
    idx[0, 2, 1] = -1
    idx[0, 5] = -1  # a query with no key at all
    out = dsa.sparse_mla_attention(q, kv, idx, scale, d_v)
    logits = torch.einsum("bthd,bsd->bths", q, kv) * scale
    allowed = torch.zeros(1, 8, 1, 8, dtype=torch.bool)
    for t in range(8):
        for i in idx[0, t].tolist():
            if i >= 0:
                allowed[0, t, 0, i] = True
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    torch.testing.assert_close(out, torch.einsum("bths,bsd->bthd", p, kv[..., :d_v]), **TIGHT)
    assert out[0, 5].abs().max() == 0


def _direct_kl(q_idx, k_idx, w_idx, q, kv, scale, allowed):
    """The indexer KL loss written out over full ``[B, S, S_kv]`` tensors (tiny shapes only)."""
    scores = torch.einsum("bthd,bsd->bths", q_idx, k_idx).relu().mul(w_idx[..., None]).sum(2)
    logits = torch.einsum("bthd,bsd->bths", q, kv) * scale
    p = torch.softmax(logits.masked_fill(~allowed[:, :, None], float("-inf")), -1).mean(2).detach()
    log_q = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return torch.where(allowed, p * (p.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)


@pytest.mark.parametrize("chunk_keys", [dsa.DENSE_CHUNK_KEYS, 1])
def test_dense_indexer_loss_matches_the_direct_formula(monkeypatch, chunk_keys):
    monkeypatch.setattr(dsa, "DENSE_CHUNK_KEYS", chunk_keys)  # 1: one query per chunk
    q, kv, q_idx, k_idx, w_idx = _inputs(extra_kv=2)
    q.requires_grad_(), kv.requires_grad_()
    scale = 0.2
    leaves = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    refs = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    allowed = _all_causal_indices(1, 12, 14)[0] >= 0
    loss = dsa.dsa_indexer_loss(*leaves, q, kv, scale)
    ref = _direct_kl(*refs, q.detach(), kv.detach(), scale, allowed[None].expand(2, 12, 14))
    assert loss.dtype == torch.float32 and loss.shape == (2, 12)
    assert (loss >= -1e-6).all()
    torch.testing.assert_close(loss, ref, **TIGHT)
    dl = torch.rand(2, 12)
    loss.backward(dl)
    ref.backward(dl)
    for got, want in zip(leaves, refs):
        torch.testing.assert_close(got.grad, want.grad, **TIGHT)
    assert q.grad is None and kv.grad is None  # the attention target is detached


def test_sparse_indexer_loss_over_every_key_equals_the_dense_loss():
    q, kv, q_idx, k_idx, w_idx = _inputs(seed=7)
    scale = 0.25
    a = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    b = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    dense = dsa.dsa_indexer_loss(*a, q, kv, scale)
    sparse = dsa.dsa_indexer_loss(*b, q, kv, scale, indices=_all_causal_indices(2, 12, 12))
    torch.testing.assert_close(sparse, dense, **TIGHT)
    dense.sum().backward()
    sparse.sum().backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad, x.grad, **TIGHT)


def test_sparse_indexer_loss_is_zero_when_the_indexer_matches_the_target():
    """KL(p || p) = 0: with the indexer's distribution equal to the attention's, the loss vanishes."""
    b, s, di = 1, 6, 8
    g = torch.Generator(torch.get_default_device()).manual_seed(2)
    k = torch.randn(b, s, di, generator=g)
    q = torch.randn(b, s, 1, di, generator=g)
    idx = _all_causal_indices(b, s, s)
    # one indexer head with w = 1 and positive dot products equals attention logits of the same vectors
    k_pos, q_pos = k.abs(), q.abs()
    loss = dsa.dsa_indexer_loss(q_pos, k_pos, torch.ones(b, s, 1), q_pos, k_pos, 1.0, indices=idx)
    torch.testing.assert_close(loss, torch.zeros(b, s), rtol=0, atol=1e-6)


def test_sparse_attention_returns_the_log_sum_exp_of_its_logits():
    """``return_lse``: the natural-log log-sum-exp of each (query, head)'s scaled logits over its
    valid keys (+inf with none), the output unchanged; the absorbed op's is that of its absorbed
    queries."""
    q, kv, _, _, _ = _inputs(extra_kv=2, seed=3)
    idx = _all_causal_indices(2, 12, 14)
    idx[1, 5] = -1  # a query with no key
    scale = 0.3
    out, lse = dsa.sparse_mla_attention(q, kv, idx, scale, 16, return_lse=True)
    torch.testing.assert_close(out, dsa.sparse_mla_attention(q, kv, idx, scale, 16), rtol=0, atol=0)
    logits = torch.einsum("bthd,bsd->bths", q, kv) * scale
    want = torch.logsumexp(logits.masked_fill((idx < 0)[:, :, None], float("-inf")), -1)
    want[1, 5] = float("inf")
    assert lse.dtype == torch.float32 and lse.shape == (2, 12, 3) and not lse.requires_grad
    torch.testing.assert_close(lse, want, **TIGHT)

    g = torch.Generator().manual_seed(4)
    q_nope, w_uk = torch.randn(2, 12, 3, 8, generator=g), torch.randn(3, 8, 16, generator=g)
    w_uv = torch.randn(3, 5, 16, generator=g)
    q_rope = q[..., 16:]
    out, lse = dsa.sparse_mla_absorbed_attention(q_nope, q_rope, kv, idx, w_uk, w_uv, scale, return_lse=True)
    _, want = dsa.sparse_mla_attention(dsa.absorb_query(q_nope, q_rope, w_uk), kv, idx, scale, 16, return_lse=True)
    torch.testing.assert_close(out, dsa.sparse_mla_absorbed_attention(q_nope, q_rope, kv, idx, w_uk, w_uv, scale),
                               rtol=0, atol=0)
    torch.testing.assert_close(lse, want, **TIGHT)


def test_sparse_indexer_loss_given_the_attentions_log_sum_exp_is_the_same_loss():
    q, kv, q_idx, k_idx, w_idx = _inputs(extra_kv=2, seed=5)
    idx = _all_causal_indices(2, 12, 14)
    idx[:, :, ::3] = -1
    _, lse = dsa.sparse_mla_attention(q, kv, idx, 0.25, 16, return_lse=True)
    a = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    b = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    plain = dsa.dsa_indexer_loss(*a, q, kv, 0.25, indices=idx)
    given = dsa.dsa_indexer_loss(*b, q, kv, 0.25, indices=idx, lse=lse)
    torch.testing.assert_close(given, plain, rtol=0, atol=0)
    plain.sum().backward()
    given.sum().backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match="give indices with it"):
        dsa.dsa_indexer_loss(q_idx, k_idx, w_idx, q, kv, 0.25, lse=lse)
    with pytest.raises(ValueError, match=r"lse \[B, S, H\]"):
        dsa.dsa_indexer_loss(q_idx, k_idx, w_idx, q, kv, 0.25, indices=idx, lse=lse[:, :, :2])


def test_bad_shapes_name_the_inputs():
    q, kv, q_idx, k_idx, w_idx = _inputs()
    with pytest.raises(ValueError, match="w_idx"):
        dsa.dsa_indexer_topk(q_idx, k_idx, w_idx[:, :, :1], 4)
    with pytest.raises(ValueError, match="indices must be"):
        dsa.sparse_mla_attention(q, kv, torch.zeros(2, 5, 3, dtype=torch.int32), 1.0, 16)
    with pytest.raises(ValueError, match="d_v=30"):
        dsa.sparse_mla_attention(q, kv, torch.zeros(2, 12, 3, dtype=torch.int32), 1.0, 30)


@pytest.mark.parametrize("batch", [1, 2])
def test_absorbed_query_written_in_place_equals_the_concatenated_form(batch):
    # a slice of tokens of queries whose nope and rope parts are views of one tensor, as the ops take them
    torch.manual_seed(0)
    q = torch.randn(batch, 7, 4, 24)
    q_nope, q_rope, w_uk = q[..., :16], q[..., 16:], torch.randn(4, 16, 32)
    want = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope[:, 2:6], w_uk), q_rope[:, 2:6]], dim=-1)
    out = torch.full((batch, 4, 4, 40), float("nan"))
    got = dsa.absorb_query(q_nope[:, 2:6], q_rope[:, 2:6], w_uk, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(dsa.absorb_query(q_nope[:, 2:6], q_rope[:, 2:6], w_uk), want, rtol=1e-6, atol=1e-5)
