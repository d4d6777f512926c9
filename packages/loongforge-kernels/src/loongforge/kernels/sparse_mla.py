"""Sparse MLA attention over per-query top-k keys (Triton), forward and backward.

Contract: ``sparse_mla_attention`` (loongforge-llm's ``loongforge.llm.ops.dsa``). MLA in its absorbed form has one
latent KV row per key shared by every head, ``kv = [c_kv (d_v), k_rope (d_rope)]``, whose first
``d_v`` entries are also the value. So one program takes one query token and a block of its
heads, and walks that token's ``topk`` indices in blocks: it gathers the selected latent rows
once, uses them as keys (two dots: latent and rope parts) and as values, and keeps an online
(running-max) softmax in fp32. The forward saves one log-sum-exp per (token, head), which the op
also returns on request (``return_lse``, natural log): the indexer loss's target
(``head_mean_probs``) then forms its probabilities in one pass over the logits instead of two.

The backward recomputes the probabilities from the saved log-sum-exp once, in two kernels per
pass of queries. The query grad: one program per (token, head block) forms its heads' ``delta =
rowsum(out * dout)`` in fp32 registers, walks the token's key blocks as the forward does,
accumulates the grad in registers and stores each block's probabilities and scaled logit grads
(``[heads, keys]`` tiles, the inputs' dtype). The key/value grad: one program per (token, block of
its selected keys) reads those tiles for every head block and sums ``ds^T q + p^T dout`` in fp32
registers, then scatters it into an fp32 ``dkv`` with one atomic add per (key, dim) (a key row is
selected by many queries): the logits and ``dp`` are formed once, the key rows gathered once per
head block of the query grad. The two buffers bound the pass (``STORED_ELEMENTS``). When one head
block holds every head, the query-grad kernel scatters the key grad itself (each key is then added
once per query already), nothing is stored and the second kernel is skipped.

Both kernels keep the logits head-major (``[heads, keys]``); their block sizes are
``backward_blocks`` (64 heads in the query grad: Hopper's warpgroup MMA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.shapes import check_shapes
from loongforge.kernels.launch import check_tensors, dot_precision

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NATURAL_TO_LOG2: tl.constexpr = tl.constexpr(LOG2E)  # a natural-log log-sum-exp to the kernels' log2 domain


def _block_sizes(n_heads: int, d_v: int, d_rope: int, elem_bytes: int, backward: bool) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_DV, BLOCK_DR)``. Heads per program: at least 16 (``tl.dot``'s smallest M), up
    to 64 in the forward (a warpgroup MMA, no spills at latent 512) and 32 in the backward's one-kernel
    form (the query grad with the key grad, whose accumulators would spill beyond); 16 for fp32
    (tests), whose tiles would not fit in shared memory at DeepSeek's sizes."""
    widest = 16 if elem_bytes > 2 else (32 if backward else 64)
    block_h = min(widest, max(16, triton.next_power_of_2(n_heads)))
    return block_h, triton.next_power_of_2(d_v), max(16, triton.next_power_of_2(max(d_rope, 1)))


@triton.jit
def _gather_keys(
    kv_base, idx_base, start, topk, stride_kvs,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    """Block ``start`` of a query's selected keys: which are valid, their rows, and the gathered
    latent ``[BLOCK_N, BLOCK_DV]`` and rope ``[BLOCK_N, BLOCK_DR]`` parts (0 where invalid)."""
    n = start + tl.arange(0, BLOCK_N)
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    idx = tl.load(idx_base + n, mask=n < topk, other=-1)
    valid = idx >= 0
    rows = tl.where(valid, idx, 0).to(tl.int64)
    row_ptr = kv_base + rows[:, None] * stride_kvs
    k_lat = tl.load(row_ptr + dv[None, :], mask=valid[:, None] & (dv[None, :] < D_V), other=0.0)
    k_rope = tl.load(row_ptr + D_V + dr[None, :], mask=valid[:, None] & (dr[None, :] < D_ROPE), other=0.0)
    return valid, rows, k_lat, k_rope


@triton.jit
def _sparse_mla_fwd(
    Q, KV, IDX, O, LSE,
    n_heads, topk, scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    head_ok = heads < n_heads
    q_row = Q + b * stride_qb + t * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=head_ok[:, None] & (dv[None, :] < D_V), other=0.0)
    q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < D_ROPE), other=0.0)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_is

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start in range(0, topk, BLOCK_N):
        valid, rows, k_lat, k_rope = _gather_keys(
            kv_base, idx_base, start, topk, stride_kvs, D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR
        )
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep everything at 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        m_i = m_new
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    o_row = O + b * stride_ob + t * stride_os + heads[:, None] * stride_oh
    tl.store(o_row + dv[None, :], out.to(O.dtype.element_ty), mask=head_ok[:, None] & (dv[None, :] < D_V))
    # log2-domain log-sum-exp of the scaled logits; +inf for a query with no key (its p is 0)
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("inf"))
    tl.store(LSE + b * stride_lb + t * stride_ls + heads, lse, mask=head_ok)


@triton.jit
def _load_heads(
    Q, DO, b, t, heads, n_heads, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    """One token's rows for a block of heads: query (latent, rope) and output grad; masked heads get zeros."""
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    head_ok = heads < n_heads
    lat_mask = head_ok[:, None] & (dv[None, :] < D_V)
    q_row = Q + b * stride_qb + t * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=lat_mask, other=0.0)
    q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < D_ROPE), other=0.0)
    do = tl.load(DO + b * stride_dob + t * stride_dos + heads[:, None] * stride_doh + dv[None, :], mask=lat_mask, other=0.0)
    return q_lat, q_rope, do


@triton.jit
def _probs_and_logit_grads(q_lat, q_rope, do, lse, delta, valid, k_lat, k_rope, scale_log2, PRECISION: tl.constexpr):
    """``[BLOCK_H, BLOCK_N]`` probabilities, recomputed from the saved log-sum-exp, and the grad of
    the (unscaled) logits, ``p * (dp - delta)``, before the softmax scale."""
    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
    s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
    p = tl.where(valid[None, :], tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(k_lat), input_precision=PRECISION)  # the value is the latent part of the key row
    return p, p * (dp - delta[:, None])


@triton.jit
def _add_key_grad(dk_lat, dk_rope, p, ds, q_lat, q_rope, do, scale, PRECISION: tl.constexpr):
    """Add one head block's share to a key block's grad: ``dk_lat += scale * ds^T q_lat + p^T do``,
    ``dk_rope += scale * ds^T q_rope`` (fp32 ``[BLOCK_N, BLOCK_DV]`` and ``[BLOCK_N, BLOCK_DR]``)."""
    ds_t = tl.trans((ds * scale).to(q_lat.dtype))
    dk_lat = tl.dot(ds_t, q_lat, dk_lat, input_precision=PRECISION)
    dk_lat = tl.dot(tl.trans(p.to(do.dtype)), do, dk_lat, input_precision=PRECISION)
    dk_rope = tl.dot(ds_t, q_rope, dk_rope, input_precision=PRECISION)
    return dk_lat, dk_rope


@triton.jit
def _scatter_key_grad(
    dkv_base, rows, valid, stride_dkvs, dk_lat, dk_rope,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    """Add a key block's grad into the fp32 rows of ``dkv`` it was gathered from, atomically (other
    queries select the same keys)."""
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    row_ptr = dkv_base + rows[:, None] * stride_dkvs
    tl.atomic_add(row_ptr + dv[None, :], dk_lat, mask=valid[:, None] & (dv[None, :] < D_V), sem="relaxed")
    tl.atomic_add(row_ptr + D_V + dr[None, :], dk_rope, mask=valid[:, None] & (dr[None, :] < D_ROPE), sem="relaxed")


@triton.jit
def _sparse_mla_bwd_dq(
    Q, KV, IDX, O, DO, LSE, DQ, DKV, PB, DSB,
    n_heads, topk, scale, scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_ls,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkvb, stride_dkvs,
    stride_pb, stride_ps, stride_ph,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr, WITH_DKV: tl.constexpr,
):
    """The query grad of one (token, head block), its heads' ``delta = rowsum(out * dout)`` formed
    here in fp32 from the output and its grad. With ``WITH_DKV`` it also scatters each gathered key
    block's grad, summed over this block's heads, into ``DKV`` (one atomic add per (key, dim) and
    head block); otherwise it stores each key block's probabilities and scaled logit grads
    (``[heads, keys]`` tiles of ``PB`` and ``DSB``, the inputs' dtype) for ``_sparse_mla_bwd_dkv``."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    q_lat, q_rope, do = _load_heads(
        Q, DO, b, t, heads, n_heads, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh,
        D_V, D_ROPE, BLOCK_DV, BLOCK_DR,
    )
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    head_ok = heads < n_heads
    lse = tl.load(LSE + b * stride_lb + t * stride_ls + heads, mask=head_ok, other=float("inf"))
    o = tl.load(O + b * stride_ob + t * stride_os + heads[:, None] * stride_oh + dv[None, :],
                mask=head_ok[:, None] & (dv[None, :] < D_V), other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    kv_base = KV + b * stride_kvb
    dkv_base = DKV + b * stride_dkvb
    idx_base = IDX + b * stride_ib + t * stride_is
    pds_heads = b * stride_pb + t * stride_ps + heads[:, None] * stride_ph

    dq_lat = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    dq_rope = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
    for start in range(0, topk, BLOCK_N):
        valid, rows, k_lat, k_rope = _gather_keys(
            kv_base, idx_base, start, topk, stride_kvs, D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR
        )
        p, ds = _probs_and_logit_grads(q_lat, q_rope, do, lse, delta, valid, k_lat, k_rope, scale_log2, PRECISION)
        ds_lo = ds.to(k_lat.dtype)
        dq_lat += tl.dot(ds_lo, k_lat, input_precision=PRECISION)
        dq_rope += tl.dot(ds_lo, k_rope, input_precision=PRECISION)
        if WITH_DKV:
            dk_lat, dk_rope = _add_key_grad(
                tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32), tl.zeros([BLOCK_N, BLOCK_DR], dtype=tl.float32),
                p, ds, q_lat, q_rope, do, scale, PRECISION,
            )
            _scatter_key_grad(dkv_base, rows, valid, stride_dkvs, dk_lat, dk_rope, D_V, D_ROPE, BLOCK_DV, BLOCK_DR)
        else:
            n = start + tl.arange(0, BLOCK_N)
            tile = pds_heads + n[None, :]
            tile_ok = head_ok[:, None] & (n[None, :] < topk)
            tl.store(PB + tile, p.to(PB.dtype.element_ty), mask=tile_ok)
            tl.store(DSB + tile, (ds * scale).to(DSB.dtype.element_ty), mask=tile_ok)
    dq_row = DQ + b * stride_dqb + t * stride_dqs + heads[:, None] * stride_dqh
    dq_type = DQ.dtype.element_ty
    tl.store(dq_row + dv[None, :], (dq_lat * scale).to(dq_type), mask=head_ok[:, None] & (dv[None, :] < D_V))
    tl.store(dq_row + D_V + dr[None, :], (dq_rope * scale).to(dq_type), mask=head_ok[:, None] & (dr[None, :] < D_ROPE))


@triton.jit
def _sparse_mla_bwd_dkv(
    Q, IDX, DO, PB, DSB, DKV,
    n_heads, topk, n_key_blocks,
    stride_qb, stride_qs, stride_qh,
    stride_ib, stride_is,
    stride_dob, stride_dos, stride_doh,
    stride_pb, stride_ps, stride_ph,
    stride_dkvb, stride_dkvs,
    D: tl.constexpr, D_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """The grad of one (token, block of its selected keys, block of ``BLOCK_D`` of the row's ``D``
    columns) from the probabilities and scaled logit grads the query-grad kernel stored: ``ds^T q``
    on every column plus ``p^T dout`` on the value's first ``D_V``, summed over every head block in
    fp32 registers (no logits formed again, no key row gathered), then scattered with one atomic
    add per (key, column). A token's key and column blocks are neighbouring programs, so its
    queries, output grads and stored tiles are mostly read from L2."""
    pid = tl.program_id(0)
    t = (pid // n_key_blocks).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    c0 = tl.program_id(2) * BLOCK_D
    n = (pid % n_key_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = c0 + tl.arange(0, BLOCK_D)
    idx = tl.load(IDX + b * stride_ib + t * stride_is + n, mask=n < topk, other=-1)
    valid = idx >= 0
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    pds_keys = b * stride_pb + t * stride_ps + n[None, :]
    h_end = tl.where(tl.max(valid.to(tl.int32)) > 0, n_heads, 0)  # a block of -1 entries only: no grad
    for h0 in range(0, h_end, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        tile = pds_keys + heads[:, None] * stride_ph
        tile_ok = head_ok[:, None] & (n[None, :] < topk)
        q = tl.load(Q + b * stride_qb + t * stride_qs + heads[:, None] * stride_qh + cols[None, :],
                    mask=head_ok[:, None] & (cols[None, :] < D), other=0.0)
        dk = tl.dot(tl.trans(tl.load(DSB + tile, mask=tile_ok, other=0.0)), q, dk, input_precision=PRECISION)
        if c0 < D_V:  # the value is the latent part of the row
            do = tl.load(DO + b * stride_dob + t * stride_dos + heads[:, None] * stride_doh + cols[None, :],
                         mask=head_ok[:, None] & (cols[None, :] < D_V), other=0.0)
            dk = tl.dot(tl.trans(tl.load(PB + tile, mask=tile_ok, other=0.0)), do, dk, input_precision=PRECISION)
    rows = tl.where(valid, idx, 0).to(tl.int64)
    tl.atomic_add(DKV + b * stride_dkvb + rows[:, None] * stride_dkvs + cols[None, :], dk,
                  mask=valid[:, None] & (cols[None, :] < D), sem="relaxed")


@triton.jit
def _head_logits(
    q_lat, q_rope, kv_base, idx_base, start, topk, stride_kvs, scale_log2,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Key block ``start`` of a query's selected keys: which are valid and the scaled log2-domain
    logits ``[BLOCK_H, BLOCK_N]`` of a block of its heads (-inf at invalid keys)."""
    valid, rows, k_lat, k_rope = _gather_keys(
        kv_base, idx_base, start, topk, stride_kvs, D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR
    )
    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
    s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
    return valid, tl.where(valid[None, :], s * scale_log2, float("-inf"))


@triton.jit
def _sparse_mla_head_mean_probs(
    Q, KV, IDX, LSE, P,
    n_heads, topk, scale_log2, inv_heads,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_lb, stride_ls,
    stride_pb, stride_ps,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr, LSE_GIVEN: tl.constexpr,
):
    """One token's row of the head-mean probabilities. Per head block: each head's log-sum-exp,
    read from ``LSE`` (natural log, the attention forward's) with ``LSE_GIVEN``, else recomputed
    in a first pass over the keys (an online max and sum); then one pass that forms the
    probabilities and adds their sum over the block's heads into the row."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    kv_base = KV + b * stride_kvb
    idx_base = IDX + b * stride_ib + t * stride_is
    p_base = P + b * stride_pb + t * stride_ps
    for h0 in range(0, n_heads, BLOCK_H):  # one program owns its token's row of P: no atomics
        heads = h0 + tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        q_row = Q + b * stride_qb + t * stride_qs + heads[:, None] * stride_qh
        q_lat = tl.load(q_row + dv[None, :], mask=head_ok[:, None] & (dv[None, :] < D_V), other=0.0)
        q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < D_ROPE), other=0.0)
        if LSE_GIVEN:  # +inf (no valid key, or a masked head) gives probabilities of 0
            lse = tl.load(LSE + b * stride_lb + t * stride_ls + heads, mask=head_ok, other=float("inf"))
            lse = lse * NATURAL_TO_LOG2
        else:
            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            for start in range(0, topk, BLOCK_N):  # the first pass: each head's log-sum-exp
                valid, s = _head_logits(q_lat, q_rope, kv_base, idx_base, start, topk, stride_kvs, scale_log2,
                                        D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR, PRECISION)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
                m_i = m_new
            lse = tl.where(head_ok & (l_i > 0), m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
        for start in range(0, topk, BLOCK_N):  # probabilities, summed over this block's heads
            valid, s = _head_logits(q_lat, q_rope, kv_base, idx_base, start, topk, stride_kvs, scale_log2,
                                    D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR, PRECISION)
            p = tl.where(valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
            n = start + tl.arange(0, BLOCK_N)
            acc = tl.load(p_base + n, mask=n < topk, other=0.0)
            tl.store(p_base + n, acc + tl.sum(p, axis=0) * inv_heads, mask=n < topk)


# The forward's keys a step: 64 in bf16/fp16 (on an H100 at V3.2's sizes, 4,096 queries of a 32K
# sequence: 9.8 ms against 14.4 ms at 32 keys), 32 in fp32 (the tests), whose tiles are twice the bytes.
FORWARD_KEYS_HALF, FORWARD_KEYS_FP32 = 64, 32
# The one-pass indexer-loss target in bf16/fp16: up to 128 heads a block, so each key row is gathered
# once per token, 64 keys a step, one stage (H100, the same queries: 5.2 ms against 14.2 ms with the
# forward's 64-head blocks; 222 KiB of shared memory at most, no spills).
TARGET_HEADS_HALF, TARGET_KEYS_HALF = 128, 64
BLOCK_N_FUSED = 16  # keys per step of the query-grad kernel when it also scatters the key grad


@dataclass(frozen=True)
class BackwardBlocks:
    """The two-kernel backward's blocks: the query-grad kernel's heads and keys a step; the key-grad
    kernel's heads a step, keys and row columns a program, and its warps; the query-grad kernel's
    warps and software-pipeline stages (at latent widths above 128)."""

    dq_heads: int
    dq_keys: int
    dkv_heads: int
    dkv_keys: int
    dkv_cols: int
    dkv_warps: int
    dq_warps: int = 8
    dq_stages: int = 1


# In bf16/fp16 at DeepSeek's sizes (latent 512 + rope 64) on sm_90: the query grad takes 64 heads x
# 32 keys a step, so its dots are warpgroup MMAs (wgmma; 172 KiB of shared memory, 32 bytes spilled)
# and a query's key rows are gathered once per 64 heads. The key grad forms no logits: it reads the
# stored probabilities and logit grads, 128 keys x 128 of the 576 columns a program (five column
# blocks, the last the rope and no value), 32 heads a step, 4 warps (wgmma). On an H100, 4,096
# queries of a 32K sequence: the whole backward 41.6 ms, against 43.0 with 8 warps and 79 ms at 64
# keys a program (bench/dsa_kernel_launches.py). fp32 (the tests) runs 16 x 16 blocks, whose tiles fit shared
# memory at DeepSeek's sizes.
HALF_BLOCKS = BackwardBlocks(dq_heads=64, dq_keys=32, dkv_heads=32, dkv_keys=128, dkv_cols=128, dkv_warps=4)
FP32_BLOCKS = BackwardBlocks(dq_heads=16, dq_keys=16, dkv_heads=16, dkv_keys=16, dkv_cols=64, dkv_warps=4)
FUSED_WARPS = 8  # the one-kernel backward's (query grad with the key grad) at latent widths above 128
# Elements of each of the two ``[queries, heads, topk]`` buffers (probabilities, logit grads) that
# carry the query-grad kernel's work to the key-grad kernel: the backward runs its queries in passes
# of ``STORED_ELEMENTS // (heads * topk)`` (256 at 128 heads and top-2048: 128 MiB each in bf16, 512
# query-grad programs a pass, about four waves of an H100's 132 SMs).
STORED_ELEMENTS = 1 << 26


def backward_blocks(elem_bytes: int) -> BackwardBlocks:
    """The two-kernel backward's blocks for elements of ``elem_bytes``."""
    return FP32_BLOCKS if elem_bytes > 2 else HALF_BLOCKS


def forward_keys(elem_bytes: int) -> int:
    """The forward's keys a step for elements of ``elem_bytes``."""
    return FORWARD_KEYS_FP32 if elem_bytes > 2 else FORWARD_KEYS_HALF


def target_blocks(n_heads: int, elem_bytes: int) -> tuple[int, int, int]:
    """``head_mean_probs``' ``(heads, keys a step, pipeline stages)`` for ``n_heads`` heads of
    ``elem_bytes`` elements: all heads (up to 128) in one block in bf16/fp16, the forward's in fp32."""
    if elem_bytes > 2:
        return _block_sizes(n_heads, 1, 0, elem_bytes, backward=False)[0], FORWARD_KEYS_FP32, 2
    return min(TARGET_HEADS_HALF, max(16, triton.next_power_of_2(n_heads))), TARGET_KEYS_HALF, 1


def _check(q, kv, indices, d_v):
    dims = check_shapes("sparse_mla_attention", q=(q, "B S H D"), kv=(kv, "B S_kv D"), indices=(indices, "B S topk"))
    if not 0 < d_v <= dims["D"]:
        raise ValueError(f"sparse_mla_attention: d_v={d_v} must be in (0, D={dims['D']}]")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla_attention: indices must be int32 or int64, got {indices.dtype}")
    if q.dtype != kv.dtype:
        raise ValueError(f"sparse_mla_attention: q dtype {q.dtype} != kv dtype {kv.dtype}")
    check_tensors("sparse_mla_attention", q, kv, indices)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def attention_forward(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
    keys_per_step: int | None = None, stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: ``(out [B, S, H, d_v], lse [B, S, H] fp32, log2 domain)``, written into
    ``out``/``lse`` when given (views with a unit last stride, e.g. one chunk of queries' rows of
    whole-sequence buffers). ``keys_per_step`` (``forward_keys`` unless given) and ``stages``: the
    kernel's key block and software pipeline depth (the kernel bench compares others)."""
    b, s, h, d = q.shape
    keys_per_step = forward_keys(q.element_size()) if keys_per_step is None else keys_per_step
    d_rope = d - d_v
    block_h, block_dv, block_dr = _block_sizes(h, d_v, d_rope, q.element_size(), backward=False)
    out = torch.empty((b, s, h, d_v), dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((b, s, h), dtype=torch.float32, device=q.device) if lse is None else lse
    if out.numel():
        _sparse_mla_fwd[(s, triton.cdiv(h, block_h), b)](
            q, kv, indices, out, lse,
            h, indices.shape[-1], softmax_scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            indices.stride(0), indices.stride(1), out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            D_V=d_v, D_ROPE=d_rope, BLOCK_H=block_h, BLOCK_N=keys_per_step, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
            PRECISION=dot_precision(q.dtype),
            num_warps=4 if block_dv <= 128 else 8, num_stages=stages,
        )
    return out, lse


def attention_backward(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, softmax_scale: float, d_v: int, dkv: torch.Tensor,
    blocks: BackwardBlocks | None = None, stored_elements: int = STORED_ELEMENTS,
) -> torch.Tensor:
    """The backward kernels: returns ``dq`` and adds the key/value grad into ``dkv`` (fp32, the shape
    of ``kv``; a caller running query chunks passes the same buffer to every chunk).

    The queries go in passes sized by ``stored_elements``. Per pass, the query grad per (token,
    head block), which also stores the probabilities and scaled logit grads it forms, then the key
    grad per (token, key block) from them, summed over every head before one atomic add per (key,
    dim): the logits and ``dp`` are formed once. ``blocks``: ``backward_blocks`` unless given (the
    kernel bench compares others). With one head block of at most 32 heads (16 in fp32) the
    query-grad kernel scatters the key grad itself, 16 keys a step, and nothing is stored."""
    b, s, h, d = q.shape
    d_rope, topk = d - d_v, indices.shape[-1]
    dq = torch.empty_like(q)
    if not dq.numel():
        return dq
    if not topk:
        return dq.zero_()
    fused_h, block_dv, block_dr = _block_sizes(h, d_v, d_rope, q.element_size(), backward=True)
    with_dkv = triton.cdiv(h, fused_h) == 1
    blocks = backward_blocks(q.element_size()) if blocks is None else blocks
    if with_dkv:
        dq_h, dq_n = fused_h, BLOCK_N_FUSED
    else:
        dq_h, dq_n = min(blocks.dq_heads, max(16, triton.next_power_of_2(h))), blocks.dq_keys
    if block_dv <= 128:  # latent widths of 128 or less (tests)
        warps, stages = 4, 1
    elif with_dkv:
        warps, stages = FUSED_WARPS, 1
    else:
        warps, stages = blocks.dq_warps, blocks.dq_stages
    sizes = dict(D_V=d_v, D_ROPE=d_rope, BLOCK_DV=block_dv, BLOCK_DR=block_dr, PRECISION=dot_precision(q.dtype))
    per_pass = s if with_dkv else max(1, min(s, stored_elements // (h * topk)))
    if with_dkv:  # nothing stored: the kernel takes dq's pointer and strides in their place
        probs = logit_grads = dq
    else:
        probs, logit_grads = (torch.empty((b, per_pass, h, topk), dtype=q.dtype, device=q.device) for _ in range(2))
    for t0 in range(0, s, per_pass):
        t1 = min(t0 + per_pass, s)
        qs, idx, do = q[:, t0:t1], indices[:, t0:t1], dout[:, t0:t1]
        os_, ls, dqs = out[:, t0:t1], lse[:, t0:t1], dq[:, t0:t1]
        _sparse_mla_bwd_dq[(t1 - t0, triton.cdiv(h, dq_h), b)](
            qs, kv, idx, os_, do, ls, dqs, dkv, probs, logit_grads, h, topk, softmax_scale, softmax_scale * LOG2E,
            qs.stride(0), qs.stride(1), qs.stride(2), kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1),
            os_.stride(0), os_.stride(1), os_.stride(2), do.stride(0), do.stride(1), do.stride(2),
            ls.stride(0), ls.stride(1), dqs.stride(0), dqs.stride(1), dqs.stride(2), dkv.stride(0), dkv.stride(1),
            probs.stride(0), probs.stride(1), probs.stride(2),
            BLOCK_H=dq_h, BLOCK_N=dq_n, WITH_DKV=with_dkv, **sizes, num_warps=warps, num_stages=stages,
        )
        if with_dkv:
            continue
        n_key_blocks = triton.cdiv(topk, blocks.dkv_keys)
        dkv_h = min(blocks.dkv_heads, max(16, triton.next_power_of_2(h)))
        _sparse_mla_bwd_dkv[((t1 - t0) * n_key_blocks, b, triton.cdiv(d, blocks.dkv_cols))](
            qs, idx, do, probs, logit_grads, dkv, h, topk, n_key_blocks,
            qs.stride(0), qs.stride(1), qs.stride(2), idx.stride(0), idx.stride(1), do.stride(0), do.stride(1),
            do.stride(2), probs.stride(0), probs.stride(1), probs.stride(2), dkv.stride(0), dkv.stride(1),
            D=d, D_V=d_v, BLOCK_H=dkv_h, BLOCK_N=blocks.dkv_keys, BLOCK_D=blocks.dkv_cols,
            PRECISION=sizes["PRECISION"], num_warps=blocks.dkv_warps, num_stages=1,
        )
    return dq


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v, return_lse):
        _check(q, kv, indices, d_v)
        q, kv, indices = _last_dim_contiguous(q), _last_dim_contiguous(kv), _last_dim_contiguous(indices)
        out, lse = attention_forward(q, kv, indices, softmax_scale, d_v)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.softmax_scale, ctx.d_v = softmax_scale, d_v
        if not return_lse:
            return out
        natural_lse = lse * LN2  # the contract's natural log (+inf stays +inf)
        ctx.mark_non_differentiable(natural_lse)
        return out, natural_lse

    @staticmethod
    def backward(ctx, dout, *_lse_grad):
        q, kv, indices, out, lse = ctx.saved_tensors
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dq = attention_backward(q, kv, indices, out, lse, _last_dim_contiguous(dout), ctx.softmax_scale, ctx.d_v, dkv)
        return dq, dkv.to(kv.dtype), None, None, None, None


@torch.no_grad()
def head_mean_probs(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, lse: torch.Tensor | None = None,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The attention distribution over each query's selected keys, averaged over heads: fp32 ``[B, S, topk]``.

    ``mean_h softmax_j(softmax_scale * q[b, t, h] . kv[b, idx_j])`` (0 at -1 entries): the target
    of DSA's sparse-stage indexer loss. One program per token runs its head blocks one after the
    other. ``lse``: the attention's log-sum-exp of the same logits, fp32 ``[B, S, H]``, natural
    log, +inf where a query has no valid key (what ``sparse_mla_attention(..., return_lse=True)``
    returns): with it each head block takes one pass over the keys (the probabilities), without it
    two (the log-sum-exp first). ``blocks``: ``(heads, keys a step, pipeline stages)``,
    ``target_blocks`` unless given (the kernel bench compares others).
    """
    _check(q, kv, indices, q.shape[-1])
    b, s, h, d = q.shape
    if lse is not None:
        check_shapes("head_mean_probs", q=(q, "B S H D"), lse=(lse, "B S H"))
        if lse.dtype != torch.float32:
            raise ValueError(f"head_mean_probs: lse must be float32, got {lse.dtype}")
        check_tensors("head_mean_probs", q, lse)
    q, kv, indices = _last_dim_contiguous(q), _last_dim_contiguous(kv), _last_dim_contiguous(indices)
    # no value here: split the key row at its largest power of two (MLA's 576 = 512 latent + 64 rope)
    d_v = 1 << (d.bit_length() - 1)
    _, block_dv, block_dr = _block_sizes(h, d_v, d - d_v, q.element_size(), backward=False)
    block_h, block_n, stages = target_blocks(h, q.element_size()) if blocks is None else blocks
    probs = torch.zeros(indices.shape, dtype=torch.float32, device=q.device)
    if probs.numel():
        lse_given = lse is not None
        lse = _last_dim_contiguous(lse) if lse_given else probs  # (not read without LSE_GIVEN)
        _sparse_mla_head_mean_probs[(s, b)](
            q, kv, indices, lse, probs,
            h, indices.shape[-1], softmax_scale * LOG2E, 1.0 / h,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            indices.stride(0), indices.stride(1), lse.stride(0), lse.stride(1), probs.stride(0), probs.stride(1),
            D_V=d_v, D_ROPE=d - d_v, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
            PRECISION=dot_precision(q.dtype), LSE_GIVEN=lse_given,
            num_warps=4 if block_dv <= 128 else 8, num_stages=stages,
        )
    return probs


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused ``sparse_mla_attention``; with ``return_lse`` also the forward's log-sum-exp (natural
    log, fp32 ``[B, S, H]``, +inf for a query with no valid key, no grad)."""
    return _SparseMLA.apply(q, kv, indices, softmax_scale, d_v, return_lse)
