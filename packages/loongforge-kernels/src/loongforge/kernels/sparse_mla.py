"""Sparse MLA attention over per-query top-k keys (Triton), forward and backward.

Contract: ``sparse_mla_attention`` (loongforge-llm's ``loongforge.llm.ops.dsa``). MLA in its absorbed form has one
latent KV row per key shared by every head, ``kv = [c_kv (d_v), k_rope (d_rope)]``, whose first
``d_v`` entries are also the value. So one program takes one query token and a block of its
heads, and walks that token's ``topk`` indices in blocks: it gathers the selected latent rows
once, uses them as keys (two dots: latent and rope parts) and as values, and keeps an online
(running-max) softmax in fp32. The forward saves one log-sum-exp per (token, head).

The backward recomputes the probabilities from the saved log-sum-exp in two kernels. The query
grad: one program per (token, head block) forms its heads' ``delta = rowsum(out * dout)`` in fp32
registers (stored for the second kernel), walks the token's key blocks as the forward does and
accumulates the grad in registers. The key/value grad: one program per (token, block of its selected
keys) loops over all head blocks, recomputing the logits and ``dp`` once more, sums the block's
grad over every head in fp32 registers and scatters it into an fp32 ``dkv`` with one atomic add
per (key, dim) (a key row is selected by many queries). When one head block holds every head,
the query-grad kernel scatters the key grad itself (each key is then added once per query
already) and the second kernel is skipped.

The key-grad kernel comes in two forms: head-major (logits ``[heads, keys]``, as the query grad
has them) and key-major (``[keys, heads]``: 64 keys are the rows of every dot, a warpgroup MMA's
64, and ``ds^T`` feeds the key-grad dot from registers). ``BACKWARD_LAUNCHES`` names the block
sizes of each launch, so a bench can time them in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.shapes import check_shapes
from loongforge.kernels.launch import check_tensors, dot_precision

LOG2E = math.log2(math.e)


def _block_sizes(n_heads: int, d_v: int, d_rope: int, elem_bytes: int, backward: bool) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_DV, BLOCK_DR)``. Heads per program: at least 16 (``tl.dot``'s smallest M), up
    to 64 in the forward (a warpgroup MMA, no spills at latent 512) and 32 in the backward (whose
    query-grad accumulator would spill beyond); 16 for fp32 (tests), whose tiles would not fit in
    shared memory at DeepSeek's sizes."""
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
    Q, DO, LSE, b, t, heads, n_heads,
    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_ls,
    D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
):
    """One token's rows for a block of heads: query (latent, rope), output grad and log-sum-exp;
    masked heads get zeros and an infinite log-sum-exp (probability 0)."""
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    head_ok = heads < n_heads
    lat_mask = head_ok[:, None] & (dv[None, :] < D_V)
    q_row = Q + b * stride_qb + t * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dv[None, :], mask=lat_mask, other=0.0)
    q_rope = tl.load(q_row + D_V + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < D_ROPE), other=0.0)
    do = tl.load(DO + b * stride_dob + t * stride_dos + heads[:, None] * stride_doh + dv[None, :], mask=lat_mask, other=0.0)
    lse = tl.load(LSE + b * stride_lb + t * stride_ls + heads, mask=head_ok, other=float("inf"))
    return q_lat, q_rope, do, lse


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
    Q, KV, IDX, O, DO, LSE, DELTA, DQ, DKV,
    n_heads, topk, scale, scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_ls,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkvb, stride_dkvs,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr, WITH_DKV: tl.constexpr,
):
    """The query grad of one (token, head block). Its ``delta = rowsum(out * dout)`` per head is
    computed here from the output and its grad (fp32 in registers) and stored for the key-grad
    kernel. With ``WITH_DKV`` it also scatters each gathered key block's grad, summed over this
    block's heads, into ``DKV`` (one atomic add per (key, dim) and head block); otherwise
    ``_sparse_mla_bwd_dkv`` does."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    q_lat, q_rope, do, lse = _load_heads(
        Q, DO, LSE, b, t, heads, n_heads, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh,
        stride_lb, stride_ls, D_V, D_ROPE, BLOCK_DV, BLOCK_DR,
    )
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    head_ok = heads < n_heads
    o = tl.load(O + b * stride_ob + t * stride_os + heads[:, None] * stride_oh + dv[None, :],
                mask=head_ok[:, None] & (dv[None, :] < D_V), other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + b * stride_lb + t * stride_ls + heads, delta, mask=head_ok)
    kv_base = KV + b * stride_kvb
    dkv_base = DKV + b * stride_dkvb
    idx_base = IDX + b * stride_ib + t * stride_is

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
    dq_row = DQ + b * stride_dqb + t * stride_dqs + heads[:, None] * stride_dqh
    dq_type = DQ.dtype.element_ty
    tl.store(dq_row + dv[None, :], (dq_lat * scale).to(dq_type), mask=head_ok[:, None] & (dv[None, :] < D_V))
    tl.store(dq_row + D_V + dr[None, :], (dq_rope * scale).to(dq_type), mask=head_ok[:, None] & (dr[None, :] < D_ROPE))


@triton.jit
def _sparse_mla_bwd_dkv(
    Q, KV, IDX, DO, LSE, DELTA, DKV,
    n_heads, topk, n_key_blocks, scale, scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_ls,
    stride_dkvb, stride_dkvs,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The grad of one (token, block of its selected keys), summed over all of the token's head
    blocks in fp32 registers, then scattered with one atomic add per (key, dim). A token's key
    blocks are neighbouring programs, so its queries and output grads are mostly read from L2."""
    pid = tl.program_id(0)
    t = (pid // n_key_blocks).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    valid, rows, k_lat, k_rope = _gather_keys(
        KV + b * stride_kvb, IDX + b * stride_ib + t * stride_is, (pid % n_key_blocks) * BLOCK_N, topk, stride_kvs,
        D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR,
    )
    dk_lat = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dk_rope = tl.zeros([BLOCK_N, BLOCK_DR], dtype=tl.float32)
    h_end = tl.where(tl.max(valid.to(tl.int32)) > 0, n_heads, 0)  # a block of -1 entries only: no grad
    for h0 in range(0, h_end, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        q_lat, q_rope, do, lse = _load_heads(
            Q, DO, LSE, b, t, heads, n_heads, stride_qb, stride_qs, stride_qh,
            stride_dob, stride_dos, stride_doh, stride_lb, stride_ls, D_V, D_ROPE, BLOCK_DV, BLOCK_DR,
        )
        delta = tl.load(DELTA + b * stride_lb + t * stride_ls + heads, mask=heads < n_heads, other=0.0)
        p, ds = _probs_and_logit_grads(q_lat, q_rope, do, lse, delta, valid, k_lat, k_rope, scale_log2, PRECISION)
        dk_lat, dk_rope = _add_key_grad(dk_lat, dk_rope, p, ds, q_lat, q_rope, do, scale, PRECISION)
    _scatter_key_grad(DKV + b * stride_dkvb, rows, valid, stride_dkvs, dk_lat, dk_rope, D_V, D_ROPE, BLOCK_DV, BLOCK_DR)


@triton.jit
def _sparse_mla_bwd_dkv_keys(
    Q, KV, IDX, DO, LSE, DELTA, DKV,
    n_heads, topk, n_key_blocks, scale, scale_log2,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_ls,
    stride_dkvb, stride_dkvs,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``_sparse_mla_bwd_dkv`` in key-major form: the logits and their grads are formed transposed,
    ``[BLOCK_N keys, BLOCK_H heads]``, so the keys are every dot's rows (``BLOCK_N`` = 64 keys: one
    warpgroup MMA tile on Hopper) and ``ds^T`` / ``p^T`` enter the key-grad dot from registers,
    with no transpose through shared memory."""
    pid = tl.program_id(0)
    t = (pid // n_key_blocks).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    valid, rows, k_lat, k_rope = _gather_keys(
        KV + b * stride_kvb, IDX + b * stride_ib + t * stride_is, (pid % n_key_blocks) * BLOCK_N, topk, stride_kvs,
        D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR,
    )
    dk_lat = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dk_rope = tl.zeros([BLOCK_N, BLOCK_DR], dtype=tl.float32)
    h_end = tl.where(tl.max(valid.to(tl.int32)) > 0, n_heads, 0)  # a block of -1 entries only: no grad
    for h0 in range(0, h_end, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        q_lat, q_rope, do, lse = _load_heads(
            Q, DO, LSE, b, t, heads, n_heads, stride_qb, stride_qs, stride_qh,
            stride_dob, stride_dos, stride_doh, stride_lb, stride_ls, D_V, D_ROPE, BLOCK_DV, BLOCK_DR,
        )
        delta = tl.load(DELTA + b * stride_lb + t * stride_ls + heads, mask=heads < n_heads, other=0.0)
        s_t = tl.dot(k_lat, tl.trans(q_lat), input_precision=PRECISION)
        s_t += tl.dot(k_rope, tl.trans(q_rope), input_precision=PRECISION)
        p_t = tl.where(valid[:, None], tl.exp2(s_t * scale_log2 - lse[None, :]), 0.0)
        dp_t = tl.dot(k_lat, tl.trans(do), input_precision=PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :]) * scale).to(q_lat.dtype)
        # dk_lat += ds^T q_lat + p^T do as one dot over 2 * BLOCK_H: [ds^T | p^T] @ [q_lat; do] (two
        # dots into one accumulator spill about 6 KiB a thread on sm_90, this one about 0.3)
        a = tl.reshape(tl.permute(tl.join(ds_t, p_t.to(do.dtype)), (0, 2, 1)), (BLOCK_N, 2 * BLOCK_H))
        b_mat = tl.reshape(tl.permute(tl.join(q_lat, do), (2, 0, 1)), (2 * BLOCK_H, BLOCK_DV))
        dk_lat = tl.dot(a, b_mat, dk_lat, input_precision=PRECISION)
        dk_rope = tl.dot(ds_t, q_rope, dk_rope, input_precision=PRECISION)
    _scatter_key_grad(DKV + b * stride_dkvb, rows, valid, stride_dkvs, dk_lat, dk_rope, D_V, D_ROPE, BLOCK_DV, BLOCK_DR)


@triton.jit
def _sparse_mla_head_mean_probs(
    Q, KV, IDX, P,
    n_heads, topk, scale_log2, inv_heads,
    stride_qb, stride_qs, stride_qh,
    stride_kvb, stride_kvs,
    stride_ib, stride_is,
    stride_pb, stride_ps,
    D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, topk, BLOCK_N):  # pass 1: each head's log-sum-exp
            valid, rows, k_lat, k_rope = _gather_keys(
                kv_base, idx_base, start, topk, stride_kvs, D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR
            )
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
            m_i = m_new
        lse = tl.where(head_ok & (l_i > 0), m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
        for start in range(0, topk, BLOCK_N):  # pass 2: probabilities, summed over this block's heads
            valid, rows, k_lat, k_rope = _gather_keys(
                kv_base, idx_base, start, topk, stride_kvs, D_V, D_ROPE, BLOCK_N, BLOCK_DV, BLOCK_DR
            )
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
            p = tl.where(valid[None, :], tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
            n = start + tl.arange(0, BLOCK_N)
            acc = tl.load(p_base + n, mask=n < topk, other=0.0)
            tl.store(p_base + n, acc + tl.sum(p, axis=0) * inv_heads, mask=n < topk)


BLOCK_N_FWD = 32
BLOCK_N_FUSED = 16  # keys per step of the query-grad kernel when it also scatters the key grad


@dataclass(frozen=True)
class BackwardLaunch:
    """Block sizes and launch parameters of the two backward kernels in bf16/fp16 (fp32, for the
    tests, always runs 16 heads x 16 keys, whose tiles fit shared memory at DeepSeek's sizes).

    ``dq_*``: ``_sparse_mla_bwd_dq`` (heads per program, keys per step). ``dkv_form``:
    ``"head_major"`` (``_sparse_mla_bwd_dkv``: logits ``[heads, keys]``) or ``"key_major"``
    (``_sparse_mla_bwd_dkv_keys``: ``[keys, heads]``); ``dkv_*``: its heads per step and keys per
    program."""

    dq_heads: int
    dq_keys: int
    dq_warps: int
    dq_stages: int
    dkv_form: str
    dkv_heads: int
    dkv_keys: int
    dkv_warps: int
    dkv_stages: int

    def for_dtype(self, elem_bytes: int) -> BackwardLaunch:
        if elem_bytes <= 2:
            return self
        return replace(self, dq_heads=16, dq_keys=16, dkv_heads=16, dkv_keys=16)


# The backward's launches at DeepSeek's sizes (latent 512 + rope 64, bf16) on sm_90, with ptxas'
# counts (255 registers at most a thread). "warpgroup" (the default): the query grad takes 64 heads
# x 32 keys a step, so its dots are warpgroup MMAs (wgmma, 172 KiB of shared memory, 68 bytes
# spilled) and a query's key rows are gathered for two head blocks instead of four; then the
# key-major key-grad kernel, 64 keys a program (the wgmma's 64 rows) x 32 heads a step, software-
# pipelined (2 stages, 208 KiB, 344 bytes spilled), which re-reads each query's heads once per 64
# keys instead of 32. "warpgroup_head_major": the same query grad, then the head-major key-grad
# kernel, 32 heads x 32 keys (mma.sync, no spills). "mma": the first launch, 32 heads x 16 keys
# and 32 x 32, whose dots are below the warpgroup MMA's 64 rows and run as mma.sync.
BACKWARD_LAUNCHES = {
    "warpgroup": BackwardLaunch(64, 32, 8, 1, "key_major", 32, 64, 8, 2),
    "warpgroup_head_major": BackwardLaunch(64, 32, 8, 1, "head_major", 32, 32, 8, 1),
    "mma": BackwardLaunch(32, 16, 8, 1, "head_major", 32, 32, 8, 1),
}
DEFAULT_BACKWARD = "warpgroup"


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


KEY_GRADS = ("head_summed", "per_head_block")


def attention_forward(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: ``(out [B, S, H, d_v], lse [B, S, H] fp32, log2 domain)``, written into
    ``out``/``lse`` when given (views with a unit last stride, e.g. one chunk of queries' rows of
    whole-sequence buffers)."""
    b, s, h, d = q.shape
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
            D_V=d_v, D_ROPE=d_rope, BLOCK_H=block_h, BLOCK_N=BLOCK_N_FWD, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
            PRECISION=dot_precision(q.dtype),
            num_warps=4 if block_dv <= 128 else 8, num_stages=2,
        )
    return out, lse


def attention_backward(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, softmax_scale: float, d_v: int, dkv: torch.Tensor, key_grad: str = "head_summed",
    launch: BackwardLaunch | str = DEFAULT_BACKWARD,
) -> torch.Tensor:
    """The backward kernels: returns ``dq`` and adds the key/value grad into ``dkv`` (fp32, the shape
    of ``kv``; a caller running query chunks passes the same buffer to every chunk).

    ``key_grad``: ``"head_summed"`` sums each key block's grad over every head in a second kernel
    before one atomic add per (key, dim), recomputing the logits there; ``"per_head_block"`` has the
    query-grad kernel scatter it per head block (no second kernel, one atomic add per (key, dim)
    and head block; 32 heads x 16 keys a step, whose fp32 key-grad tile leaves no room for more).
    With at most one such head block both are that one kernel. ``launch``: the two-kernel form's
    block sizes, a ``BackwardLaunch`` or a name in ``BACKWARD_LAUNCHES``."""
    if key_grad not in KEY_GRADS:
        raise ValueError(f"sparse_mla_attention: key_grad must be one of {KEY_GRADS}, got {key_grad!r}")
    if isinstance(launch, str):
        if launch not in BACKWARD_LAUNCHES:
            raise ValueError(f"sparse_mla_attention: launch must be one of {tuple(BACKWARD_LAUNCHES)}, got {launch!r}")
        launch = BACKWARD_LAUNCHES[launch]
    b, s, h, d = q.shape
    d_rope, topk = d - d_v, indices.shape[-1]
    dq = torch.empty_like(q)
    if not dq.numel():
        return dq
    if not topk:
        return dq.zero_()
    lse = lse.contiguous()  # (a chunk's rows of a whole-sequence buffer) delta is written with its strides
    delta = torch.empty_like(lse)  # rowwise sum(p * dp) = sum(out * dout), from the query-grad kernel
    fused_h, block_dv, block_dr = _block_sizes(h, d_v, d_rope, q.element_size(), backward=True)
    with_dkv = key_grad == "per_head_block" or triton.cdiv(h, fused_h) == 1
    launch = launch.for_dtype(q.element_size())
    if with_dkv:
        dq_h, dq_n, dq_warps, dq_stages = fused_h, BLOCK_N_FUSED, 8, 1
    else:
        dq_h, dq_n = min(launch.dq_heads, max(16, triton.next_power_of_2(h))), launch.dq_keys
        dq_warps, dq_stages = launch.dq_warps, launch.dq_stages
    small = block_dv <= 128  # latent widths of 128 or less (tests): 4 warps
    scales = (softmax_scale, softmax_scale * LOG2E)
    q_strides = (q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1))
    grad_strides = (dout.stride(0), dout.stride(1), dout.stride(2), lse.stride(0), lse.stride(1))
    sizes = dict(D_V=d_v, D_ROPE=d_rope, BLOCK_DV=block_dv, BLOCK_DR=block_dr, PRECISION=dot_precision(q.dtype))
    _sparse_mla_bwd_dq[(s, triton.cdiv(h, dq_h), b)](
        q, kv, indices, out, dout, lse, delta, dq, dkv, h, topk, *scales, *q_strides,
        out.stride(0), out.stride(1), out.stride(2), *grad_strides,
        dq.stride(0), dq.stride(1), dq.stride(2), dkv.stride(0), dkv.stride(1),
        BLOCK_H=dq_h, BLOCK_N=dq_n, WITH_DKV=with_dkv, **sizes,
        num_warps=4 if small else dq_warps, num_stages=dq_stages,
    )
    if not with_dkv:
        kernel = _sparse_mla_bwd_dkv_keys if launch.dkv_form == "key_major" else _sparse_mla_bwd_dkv
        n_key_blocks = triton.cdiv(topk, launch.dkv_keys)
        kernel[(s * n_key_blocks, b)](
            q, kv, indices, dout, lse, delta, dkv, h, topk, n_key_blocks, *scales, *q_strides, *grad_strides,
            dkv.stride(0), dkv.stride(1),
            BLOCK_H=launch.dkv_heads, BLOCK_N=launch.dkv_keys, **sizes,
            num_warps=4 if small else launch.dkv_warps, num_stages=launch.dkv_stages,
        )
    return dq


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, softmax_scale, d_v):
        _check(q, kv, indices, d_v)
        q, kv, indices = _last_dim_contiguous(q), _last_dim_contiguous(kv), _last_dim_contiguous(indices)
        out, lse = attention_forward(q, kv, indices, softmax_scale, d_v)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.softmax_scale, ctx.d_v = softmax_scale, d_v
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, indices, out, lse = ctx.saved_tensors
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dq = attention_backward(q, kv, indices, out, lse, _last_dim_contiguous(dout), ctx.softmax_scale, ctx.d_v, dkv)
        return dq, dkv.to(kv.dtype), None, None, None


@torch.no_grad()
def head_mean_probs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """The attention distribution over each query's selected keys, averaged over heads: fp32 ``[B, S, topk]``.

    ``mean_h softmax_j(softmax_scale * q[b, t, h] . kv[b, idx_j])`` (0 at -1 entries): the target
    of DSA's sparse-stage indexer loss. One program per token runs its head blocks one after the
    other, two passes each (log-sum-exp, then probabilities).
    """
    _check(q, kv, indices, q.shape[-1])
    q, kv, indices = _last_dim_contiguous(q), _last_dim_contiguous(kv), _last_dim_contiguous(indices)
    b, s, h, d = q.shape
    # no value here: split the key row at its largest power of two (MLA's 576 = 512 latent + 64 rope)
    d_v = 1 << (d.bit_length() - 1)
    block_h, block_dv, block_dr = _block_sizes(h, d_v, d - d_v, q.element_size(), backward=False)
    probs = torch.zeros(indices.shape, dtype=torch.float32, device=q.device)
    if probs.numel():
        _sparse_mla_head_mean_probs[(s, b)](
            q, kv, indices, probs,
            h, indices.shape[-1], softmax_scale * LOG2E, 1.0 / h,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            indices.stride(0), indices.stride(1), probs.stride(0), probs.stride(1),
            D_V=d_v, D_ROPE=d - d_v, BLOCK_H=block_h, BLOCK_N=BLOCK_N_FWD, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
                PRECISION=dot_precision(q.dtype),
            num_warps=4 if block_dv <= 128 else 8, num_stages=2,
        )
    return probs


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int
) -> torch.Tensor:
    """Fused ``sparse_mla_attention``."""
    return _SparseMLA.apply(q, kv, indices, softmax_scale, d_v)
