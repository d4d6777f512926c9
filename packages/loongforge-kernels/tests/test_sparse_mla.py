"""Fused sparse MLA attention and the lightning indexer vs the torch references (Triton interpreter).

fp32 only: the interpreter's ``tl.dot`` gives wrong results for bf16 operands, so bf16 is checked
on a GPU (test_dsa_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from loongforge.kernels.dsa_indexer import dsa_indexer_loss, dsa_indexer_topk, indexer_scores_chunk
from loongforge.kernels import sparse_mla
from loongforge.kernels.launch import INTERPRETED
from loongforge.kernels.sparse_mla import head_mean_probs, sparse_mla_attention
from loongforge.kernels.sparse_mla_absorbed import sparse_mla_absorbed_attention
from loongforge.llm.ops import dsa

TIGHT = dict(rtol=1e-5, atol=1e-5)


def _attention_inputs(b, s, h, d_v, d_rope, topk, extra_kv=0, dtype=torch.float32, seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    n_kv = s + extra_kv
    q = torch.randn(b, s, h, d_v + d_rope, generator=g).to(dtype)
    kv = torch.randn(b, n_kv, d_v + d_rope, generator=g).to(dtype)
    idx = torch.randint(0, n_kv, (b, s, topk), generator=g, dtype=torch.int32)
    idx[torch.rand(b, s, topk, generator=g) < 0.2] = -1
    return q, kv, idx


def _run(fn, q, kv, idx, scale, d_v, dout):
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = fn(q, kv, idx, scale, d_v)
    out.backward(dout)
    return out, q.grad, kv.grad


@pytest.mark.parametrize(
    "b, s, h, d_v, d_rope, topk, extra_kv",
    [
        # masked heads in one head block (the query-grad kernel scatters the key grad), two key blocks
        # fwd / three bwd, a longer key sequence
        (2, 6, 3, 32, 16, 40, 5),
        # two head blocks (the key grad from the second kernel), d_v and d_rope not powers of two
        (1, 5, 18, 24, 8, 7, 0),
        (1, 4, 40, 32, 16, 37, 2),  # three head blocks, the last partial; three key blocks, the last partial
    ],
)
def test_sparse_mla_forward_backward_fp32(b, s, h, d_v, d_rope, topk, extra_kv):
    q, kv, idx = _attention_inputs(b, s, h, d_v, d_rope, topk, extra_kv)
    idx[0, 1, :3] = idx[0, 1, 3]  # repeated keys count once per entry
    idx[0, 2] = -1  # a query with no key: output and grads 0
    idx[0, 3, -min(topk, 16):] = -1  # a last key block of -1 entries only (with 20% -1 elsewhere)
    scale = (d_v + d_rope) ** -0.5
    dout = torch.randn(b, s, h, d_v)
    out, dq, dkv = _run(sparse_mla_attention, q, kv, idx, scale, d_v, dout)
    ref, dq_ref, dkv_ref = _run(dsa.sparse_mla_attention, q, kv, idx, scale, d_v, dout)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TIGHT)
    torch.testing.assert_close(dq, dq_ref, **TIGHT)
    torch.testing.assert_close(dkv, dkv_ref, **TIGHT)
    assert out[0, 2].abs().max() == 0 and dq[0, 2].abs().max() == 0


@pytest.mark.parametrize("cols", [16, 64])  # the key grad's column blocks: three (value, value + rope, rope) or one
def test_two_kernel_backward_in_passes_matches_the_reference(cols):
    """The two-kernel backward (18 heads: two head blocks) with its queries in passes of two (the
    last short), so its stored probabilities and logit grads are reused across passes, and the key
    grad in column blocks that split the value from the rope mid-block; ``dkv`` accumulates into
    what is already there, as the absorbed op's query chunks do."""
    b, s, h, d_v, d_rope, topk = 1, 5, 18, 24, 20, 21
    q, kv, idx = _attention_inputs(b, s, h, d_v, d_rope, topk, extra_kv=3, seed=7)
    idx[0, 4, 5:] = -1
    scale = (d_v + d_rope) ** -0.5
    dout = torch.randn(b, s, h, d_v, generator=torch.Generator(torch.get_default_device()).manual_seed(8))
    _, dq_ref, dkv_ref = _run(dsa.sparse_mla_attention, q, kv, idx, scale, d_v, dout)
    out, lse = sparse_mla.attention_forward(q, kv, idx, scale, d_v)
    blocks = sparse_mla.BackwardBlocks(dq_heads=16, dq_keys=16, dkv_heads=16, dkv_keys=16, dkv_cols=cols, dkv_warps=4)
    dkv = torch.ones(kv.shape)
    dq = sparse_mla.attention_backward(q, kv, idx, out, lse, dout, scale, d_v, dkv, blocks=blocks,
                                       stored_elements=2 * h * topk)
    torch.testing.assert_close(dq, dq_ref, **TIGHT)
    torch.testing.assert_close(dkv - 1, dkv_ref, **TIGHT)


def _absorbed_inputs(b, s, h, d_nope, d_rope, d_c, d_v, topk, extra_kv, seed):
    q, kv, idx = _attention_inputs(b, s, h, d_c, d_rope, topk, extra_kv, seed=seed)
    g = torch.Generator(torch.get_default_device()).manual_seed(seed + 1)
    q_nope = torch.randn(b, s, h, d_nope, generator=g)
    w_uk = torch.randn(h, d_nope, d_c, generator=g) * d_nope**-0.5
    w_uv = torch.randn(h, d_v, d_c, generator=g) * d_c**-0.5
    return [q_nope, q[..., d_c:].contiguous(), kv, w_uk, w_uv], idx


@pytest.mark.parametrize("chunk_elements", [1 << 20, 2 * 18 * 40])  # one chunk; chunks of 2 queries (the last short)
def test_sparse_mla_absorbed_matches_the_reference(chunk_elements):
    """Outputs and the grads of all five inputs, with the queries in one chunk or several."""
    tensors, idx = _absorbed_inputs(2, 5, 18, 12, 8, 32, 16, 37, 3, seed=5)
    idx[0, 2] = -1  # a query with no key
    scale = 0.3
    dout = torch.randn(2, 5, 18, 16)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = sparse_mla_absorbed_attention(*leaves[:3], idx, *leaves[3:], scale, chunk_elements=chunk_elements)
    out.backward(dout)
    refs = [t.clone().requires_grad_() for t in tensors]
    want = dsa.sparse_mla_absorbed_attention(*refs[:3], idx, *refs[3:], scale)
    want.backward(dout)
    assert out.shape == want.shape == (2, 5, 18, 16)
    torch.testing.assert_close(out, want, **TIGHT)
    for got, ref in zip(leaves, refs):
        torch.testing.assert_close(got.grad, ref.grad, **TIGHT)


def test_absorbed_reference_is_sparse_attention_between_the_projections():
    tensors, idx = _absorbed_inputs(1, 4, 3, 8, 8, 16, 8, 6, 0, seed=7)
    q_nope, q_rope, kv, w_uk, w_uv = tensors
    q_abs = torch.cat([torch.einsum("bshd,hdc->bshc", q_nope, w_uk), q_rope], -1)
    o_lat = dsa.sparse_mla_attention(q_abs, kv, idx, 0.5, 16)
    want = torch.einsum("bshc,hvc->bshv", o_lat, w_uv)
    torch.testing.assert_close(dsa.sparse_mla_absorbed_attention(q_nope, q_rope, kv, idx, w_uk, w_uv, 0.5), want, **TIGHT)


def _indexer_inputs(b, s, hi, di, extra_kv=0, dtype=torch.float32, seed=0):
    """Indexer inputs without ties: head 0 scores every key above 0 (a ReLU of all heads at 0 ties)."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    q = torch.randn(b, s, hi, di, generator=g)
    k = torch.randn(b, s + extra_kv, di, generator=g).abs()
    q[:, :, 0] = q[:, :, 0].abs() + 0.1
    w = torch.rand(b, s, hi, generator=g) + 0.1
    return q.to(dtype), k.to(dtype), w


def test_indexer_scores_match_the_reference():
    q, k, w = _indexer_inputs(2, 70, 3, 20, extra_kv=9)  # two query blocks, two key blocks, 20-dim heads
    buf = torch.empty(2, 70, 79)
    for t0, t1 in ((0, 70), (30, 41)):
        got = indexer_scores_chunk(q, k, w, t0, t1, buf)
        width = t1 + 9
        want = dsa.indexer_scores(q[:, t0:t1], k[:, :width], w[:, t0:t1])
        want = want.masked_fill(~dsa._causal_mask(t0, t1, width, 9, q.device), float("-inf"))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize("topk, extra_kv", [(5, 0), (12, 3), (40, 2)])
def test_topk_selection_identical_to_the_reference(topk, extra_kv):
    q, k, w = _indexer_inputs(2, 33, 4, 16, extra_kv=extra_kv, seed=topk)
    got = dsa_indexer_topk(q, k, w, topk)
    want = dsa.dsa_indexer_topk(q, k, w, topk)
    assert got.dtype == torch.int32 and got.shape == want.shape == (2, 33, topk)
    torch.testing.assert_close(got.sort(-1).values, want.sort(-1).values, rtol=0, atol=0)


def test_fused_dsa_with_k_equal_to_s_is_dense_causal_attention():
    """Fused top-k with k = S selects every causal key; fused sparse attention over it is dense attention."""
    b, s, h, d_v, d_rope = 1, 9, 2, 16, 16
    q_idx, k_idx, w_idx = _indexer_inputs(b, s, 2, 16, seed=4)
    q, kv, _ = _attention_inputs(b, s, h, d_v, d_rope, 1, seed=4)
    idx = dsa_indexer_topk(q_idx, k_idx, w_idx, s)
    scale = 0.2
    dout = torch.randn(b, s, h, d_v)
    out, dq, dkv = _run(sparse_mla_attention, q, kv, idx, scale, d_v, dout)

    qd, kvd = q.clone().requires_grad_(), kv.clone().requires_grad_()
    logits = torch.einsum("bthd,bsd->bths", qd, kvd) * scale
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, :, None, :]
    dense = torch.einsum("bths,bsd->bthd", torch.softmax(logits.masked_fill(~causal, float("-inf")), -1), kvd[..., :d_v])
    dense.backward(dout)
    torch.testing.assert_close(out, dense, **TIGHT)
    torch.testing.assert_close(dq, qd.grad, **TIGHT)
    torch.testing.assert_close(dkv, kvd.grad, **TIGHT)


def test_head_mean_probs_are_the_attention_distribution():
    q, kv, idx = _attention_inputs(2, 5, 20, 32, 16, 37, 3, seed=6)  # two head blocks, two key blocks
    idx[1, 3] = -1
    got = head_mean_probs(q, kv, idx, 0.3)
    sel = dsa._gather_rows(kv, idx)
    logits = torch.einsum("bthd,btkd->bthk", q, sel) * 0.3
    valid = (idx >= 0)[:, :, None, :]
    want = torch.softmax(logits.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0).mean(2)
    torch.testing.assert_close(got, want, **TIGHT)
    assert got[1, 3].abs().max() == 0


def _causal_topk(b, s, topk, extra_kv, seed):
    """``[B, S, topk]`` int32: distinct random keys at or before each query, -1 padded where a query
    sees fewer than ``topk`` keys (the first queries), with some entries dropped to -1 as well."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    n_kv = s + extra_kv
    visible = torch.arange(n_kv)[None, :] <= torch.arange(s)[:, None] + extra_kv
    scores = torch.rand(b, s, n_kv, generator=g).masked_fill(~visible, -1.0)
    val, idx = scores.topk(min(topk, n_kv), dim=-1)
    idx = torch.where(val >= 0, idx, -1)
    idx[torch.rand(idx.shape, generator=g) < 0.15] = -1
    return torch.nn.functional.pad(idx, (0, topk - idx.shape[-1]), value=-1).to(torch.int32)


def _reference_head_mean_probs(q, kv, idx, scale):
    sel = dsa._gather_rows(kv.float(), idx)
    logits = torch.einsum("bthd,btkd->bthk", q.float(), sel) * scale
    valid = (idx >= 0)[:, :, None, :]
    return torch.softmax(logits.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0).mean(2)


HALF_LOOSE = dict(rtol=2e-2, atol=2e-4)  # half-precision logits against the fp32 reference of the same inputs


@pytest.mark.parametrize("dtype", [
    torch.float32,
    torch.float16,
    # the interpreter's tl.dot is wrong for bf16 operands: bf16 runs where the kernels are compiled
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason="bf16 dots need the compiled kernels")),
])
@pytest.mark.parametrize(
    "b, s, h, d_v, d_rope, topk, extra_kv",
    [
        # fp32 takes 16 heads a block, half precision up to 64: two head blocks in fp32 (one in half), two
        # key blocks, every row -1 padded past its causal keys
        (2, 7, 20, 32, 16, 37, 3),
        (1, 6, 40, 24, 8, 70, 0),  # three head blocks in fp32 (the last partial), three key blocks (the last partial)
    ],
)
def test_one_pass_target_equals_the_two_pass_one_and_the_reference(dtype, b, s, h, d_v, d_rope, topk, extra_kv):
    """The indexer loss's target from the attention forward's log-sum-exp (one pass over the
    logits) against the target that recomputes it (two passes) and the torch softmax: masked
    (-1) entries, the causal edge's padding, a query with no valid key and a last key block of -1
    entries only."""
    q, kv, _ = _attention_inputs(b, s, h, d_v, d_rope, 1, extra_kv, dtype=dtype, seed=h)
    idx = _causal_topk(b, s, topk, extra_kv, seed=h)
    idx[0, 1] = -1  # a query with no key: its row is 0
    idx[-1, -1, 32:] = -1  # a last key block with -1 entries only
    scale = (d_v + d_rope) ** -0.5
    _, lse = sparse_mla_attention(q, kv, idx, scale, d_v, return_lse=True)
    one_pass = head_mean_probs(q, kv, idx, scale, lse)
    two_pass = head_mean_probs(q, kv, idx, scale)
    want = _reference_head_mean_probs(q, kv, idx, scale)
    assert one_pass.dtype == torch.float32 and one_pass.shape == (b, s, topk)
    assert one_pass[0, 1].abs().max() == 0 and (one_pass[idx < 0] == 0).all()
    tol = TIGHT if dtype == torch.float32 else HALF_LOOSE
    torch.testing.assert_close(one_pass, two_pass, **tol)
    torch.testing.assert_close(one_pass, want, **tol)
    # every head in one block, one key block a step fewer (the kernel bench's alternative)
    torch.testing.assert_close(head_mean_probs(q, kv, idx, scale, lse, blocks=(64, 16, 1)), one_pass, **tol)
    torch.testing.assert_close(one_pass.sum(-1), (idx >= 0).any(-1).float(), **tol)  # rows sum to 1 (0 with no key)


def test_one_pass_target_takes_its_normaliser_from_the_given_log_sum_exp():
    """The one-pass target reads ``lse`` (natural log) instead of recomputing it: the reference
    attention's gives the same target, and a log-sum-exp raised by log 2 halves every probability."""
    q, kv, _ = _attention_inputs(1, 5, 18, 32, 16, 1, 2, seed=11)
    idx = _causal_topk(1, 5, 40, 2, seed=11)
    scale = 0.2
    _, lse = sparse_mla_attention(q, kv, idx, scale, 32, return_lse=True)
    _, ref_lse = dsa.sparse_mla_attention(q, kv, idx, scale, 32, return_lse=True)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)
    target = head_mean_probs(q, kv, idx, scale, lse)
    torch.testing.assert_close(head_mean_probs(q, kv, idx, scale, ref_lse), target, **TIGHT)
    torch.testing.assert_close(head_mean_probs(q, kv, idx, scale, lse + math.log(2.0)), target / 2, **TIGHT)
    with pytest.raises(ValueError, match="lse"):
        head_mean_probs(q, kv, idx, scale, lse[:, :, :4])
    with pytest.raises(ValueError, match="float32"):
        head_mean_probs(q, kv, idx, scale, lse.double())


def test_fused_attention_returns_the_references_log_sum_exp():
    """``return_lse`` of both fused attention ops: the reference's log-sum-exp (+inf for a query
    with no key), the outputs and grads as without it."""
    q, kv, idx = _attention_inputs(2, 6, 3, 32, 16, 40, 5)
    idx[0, 2] = -1
    out, lse = sparse_mla_attention(q, kv, idx, 0.3, 32, return_lse=True)
    ref_out, ref_lse = dsa.sparse_mla_attention(q, kv, idx, 0.3, 32, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 6, 3) and not lse.requires_grad
    assert torch.isinf(lse[0, 2]).all() and (lse[0, 2] > 0).all()
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(lse, ref_lse, **TIGHT)

    tensors, idx = _absorbed_inputs(2, 5, 18, 12, 8, 32, 16, 37, 3, seed=5)
    idx[1, 3] = -1
    dout = torch.randn(2, 5, 18, 16)
    grads = []
    for return_lse in (False, True):
        leaves = [t.clone().requires_grad_() for t in tensors]
        got = sparse_mla_absorbed_attention(*leaves[:3], idx, *leaves[3:], 0.3, return_lse=return_lse,
                                            chunk_elements=2 * 18 * 40)  # chunks of 2 queries
        out = got[0] if return_lse else got
        out.backward(dout)
        grads.append([t.grad for t in leaves])
    _, ref_lse = dsa.sparse_mla_absorbed_attention(*tensors[:3], idx, *tensors[3:], 0.3, return_lse=True)
    torch.testing.assert_close(got[1], ref_lse, **TIGHT)
    for with_lse, without in zip(grads[1], grads[0]):
        torch.testing.assert_close(with_lse, without, rtol=0, atol=0)


def test_the_fused_ops_and_the_references_take_the_same_arguments():
    """One contract per op: the provider's function, the fused one and the reference have the same
    parameters and defaults up to the reference's (the fused absorbed op adds its chunk size)."""
    import inspect

    from loongforge.kernels import dsa_indexer, provider, sparse_mla, sparse_mla_absorbed

    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    for name, fused in (("sparse_mla_attention", sparse_mla.sparse_mla_attention),
                        ("sparse_mla_absorbed_attention", sparse_mla_absorbed.sparse_mla_absorbed_attention),
                        ("dsa_indexer_loss", dsa_indexer.dsa_indexer_loss)):
        want = params(getattr(dsa, name))
        assert params(getattr(provider, name)) == want, name
        assert params(fused)[: len(want)] == want, name


@pytest.mark.parametrize("with_lse", [False, True], ids=["two-pass-target", "one-pass-target"])
def test_sparse_indexer_loss_matches_the_reference(with_lse):
    """The fused loss against the reference, its target recomputing each head's log-sum-exp or
    taking the fused attention's (a query with no valid key included)."""
    b, s, h, hi, di = 2, 11, 3, 5, 24
    q_idx, k_idx, w_idx = _indexer_inputs(b, s, hi, di, extra_kv=2, seed=8)
    q, kv, _ = _attention_inputs(b, s, h, 32, 16, 1, extra_kv=2, seed=8)
    idx = dsa_indexer_topk(q_idx, k_idx, w_idx, 70)  # > one key block, -1 padded
    idx[0, 4, :2] = -1
    idx[1, 6] = -1
    lse = sparse_mla_attention(q, kv, idx, 0.25, 32, return_lse=True)[1] if with_lse else None
    leaves = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    refs = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    loss = dsa_indexer_loss(*leaves, q, kv, 0.25, idx, lse)
    want = dsa.dsa_indexer_loss(*refs, q, kv, 0.25, indices=idx)
    torch.testing.assert_close(loss, want, **TIGHT)
    dl = torch.rand(b, s)
    loss.backward(dl)
    want.backward(dl)
    for got, ref in zip(leaves, refs):
        torch.testing.assert_close(got.grad, ref.grad, **TIGHT)


def test_fused_ops_reject_mismatched_inputs():
    q, kv, idx = _attention_inputs(1, 4, 2, 16, 16, 4)
    with pytest.raises(ValueError, match="q dtype"):
        sparse_mla_attention(q, kv.double(), idx, 1.0, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        sparse_mla_attention(q, kv, idx.float(), 1.0, 16)
    q_idx, k_idx, w_idx = _indexer_inputs(1, 4, 2, 16)
    with pytest.raises(ValueError, match="topk must be"):
        dsa_indexer_topk(q_idx, k_idx, w_idx, 0)
