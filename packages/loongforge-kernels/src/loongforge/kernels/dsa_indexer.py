"""Lightning-indexer scoring for DSA (Triton): top-k selection and the sparse-stage KL loss.

Contracts: ``dsa_indexer_topk`` and ``dsa_indexer_loss`` (loongforge-llm's
``loongforge.llm.ops.dsa``). The score of query ``t`` and key ``s`` is
``sum_j w[t, j] * relu(q[t, j] . k[s])`` over the indexer's few heads. The torch reference
forms the ``[queries, heads, keys]`` products before the ReLU-weighted head sum; the kernel keeps
one ``[BLOCK_M, BLOCK_N]`` fp32 tile of the sum in registers and adds one head at a time, so only
the head-summed scores ever reach memory, and key blocks wholly in a query block's future are
skipped (written as -inf). Queries go in chunks whose ``[chunk, keys]`` fp32 scores take about
``S * topk`` elements; each chunk's top-k is ``torch.topk`` over those scores.

The sparse-stage loss works on ``[B, S, topk]`` tensors only. Its target (the attention's
head-mean distribution over the selected keys) comes from ``sparse_mla.head_mean_probs``, in one
pass over the logits where the caller hands over the attention forward's log-sum-exp (``lse``),
else in two; the
indexer's scores at the selected keys from a gather kernel (one program per token: its ``[HI, DI]``
queries against each block of gathered keys, one dot); the KL and its grad w.r.t. the scores are a
few elementwise torch ops; and a backward kernel turns that grad into the indexer's input grads,
scattering the key grads with fp32 atomic adds. The dense warm-up loss (no ``indices``) is the
torch reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels import get_op
from loongforge.core.kernels.shapes import check_shapes
from loongforge.kernels.launch import check_tensors, dot_precision
from loongforge.kernels.sparse_mla import head_mean_probs

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _indexer_scores(
    Q, K, W, OUT,
    t0, n_rows, n_cols, offset, n_heads,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks,
    stride_wb, stride_ws,
    stride_ob, stride_os,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the chunk
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions
    d = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    t = (t0 + rows).to(tl.int64)
    visible = (cols[None, :] <= t[:, None] + offset) & (cols[None, :] < n_cols) & row_ok[:, None]
    # a key block entirely after the block's last query contributes nothing: run no head for it
    last_query = t0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1
    heads_to_run = tl.where(pid_n * BLOCK_N <= last_query + offset, n_heads, 0)

    k = tl.load(
        K + b * stride_kb + cols[:, None].to(tl.int64) * stride_ks + d[None, :],
        mask=(cols[:, None] < n_cols) & (d[None, :] < DIM), other=0.0,
    )
    q_rows = Q + b * stride_qb + t[:, None] * stride_qs + d[None, :]
    w_rows = W + b * stride_wb + t * stride_ws
    q_mask = row_ok[:, None] & (d[None, :] < DIM)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(0, heads_to_run):
        q = tl.load(q_rows + h * stride_qh, mask=q_mask, other=0.0)
        w = tl.load(w_rows + h, mask=row_ok, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0) * w[:, None]
    acc = tl.where(visible, acc, float("-inf"))
    tl.store(
        OUT + b * stride_ob + rows[:, None].to(tl.int64) * stride_os + cols[None, :], acc,
        mask=row_ok[:, None] & (cols[None, :] < n_cols),
    )


@triton.jit
def _indexer_gather_scores(
    Q, K, W, IDX, OUT,
    n_heads, topk,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks,
    stride_wb, stride_ws,
    stride_ib, stride_is,
    stride_ob, stride_os,
    DIM: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_HI)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * stride_qb + t * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=(heads[:, None] < n_heads) & (d[None, :] < DIM), other=0.0,
    )
    w = tl.load(W + b * stride_wb + t * stride_ws + heads, mask=heads < n_heads, other=0.0).to(tl.float32)
    for start in range(0, topk, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(IDX + b * stride_ib + t * stride_is + n, mask=n < topk, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        k = tl.load(K + b * stride_kb + rows[:, None] * stride_ks + d[None, :], mask=valid[:, None] & (d[None, :] < DIM), other=0.0)
        z = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [heads, keys]
        score = tl.sum(tl.maximum(z, 0.0) * w[:, None], axis=0)
        tl.store(OUT + b * stride_ob + t * stride_os + n, tl.where(valid, score, float("-inf")), mask=n < topk)


@triton.jit
def _indexer_gather_bwd(
    Q, K, W, IDX, DS, DQ, DK, DW,
    n_heads, topk,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks,
    stride_wb, stride_ws,
    stride_ib, stride_is,
    stride_dsb, stride_dss,
    stride_dkb, stride_dks,
    DIM: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, BLOCK_HI)
    d = tl.arange(0, BLOCK_D)
    head_ok = heads < n_heads
    q_mask = head_ok[:, None] & (d[None, :] < DIM)
    q_off = b * stride_qb + t * stride_qs + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    w_off = b * stride_wb + t * stride_ws + heads
    w = tl.load(W + w_off, mask=head_ok, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_HI, BLOCK_D], dtype=tl.float32)
    dw = tl.zeros([BLOCK_HI], dtype=tl.float32)
    for start in range(0, topk, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(IDX + b * stride_ib + t * stride_is + n, mask=n < topk, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        k_mask = valid[:, None] & (d[None, :] < DIM)
        k = tl.load(K + b * stride_kb + rows[:, None] * stride_ks + d[None, :], mask=k_mask, other=0.0)
        g = tl.load(DS + b * stride_dsb + t * stride_dss + n, mask=valid, other=0.0)  # grad of each score
        z = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        dw += tl.sum(tl.maximum(z, 0.0) * g[None, :], axis=1)
        dz = tl.where(z > 0, w[:, None] * g[None, :], 0.0).to(k.dtype)
        dq += tl.dot(dz, k, input_precision=PRECISION)
        dk = tl.dot(tl.trans(dz), q, input_precision=PRECISION)
        tl.atomic_add(DK + b * stride_dkb + rows[:, None] * stride_dks + d[None, :], dk, mask=k_mask, sem="relaxed")
    tl.store(DQ + q_off, dq.to(DQ.dtype.element_ty), mask=q_mask)
    tl.store(DW + w_off, dw.to(DW.dtype.element_ty), mask=head_ok)


GATHER_BLOCK_N = 64
GATHER_WARPS = 8


def _gather_blocks(q_idx: torch.Tensor) -> dict:
    hi, dim = q_idx.shape[2:]
    return dict(
        DIM=dim, BLOCK_HI=max(16, triton.next_power_of_2(hi)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_N=GATHER_BLOCK_N, PRECISION=dot_precision(q_idx.dtype), num_warps=GATHER_WARPS,
    )


def indexer_gather_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Indexer scores of each query's selected keys: fp32 ``[B, S, topk]``, -inf at -1 entries."""
    b, s = q_idx.shape[:2]
    out = torch.empty(indices.shape, dtype=torch.float32, device=q_idx.device)
    if out.numel():
        _indexer_gather_scores[(s, b)](
            q_idx, k_idx, w_idx, indices, out, q_idx.shape[2], indices.shape[-1],
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
            w_idx.stride(0), w_idx.stride(1), indices.stride(0), indices.stride(1), out.stride(0), out.stride(1),
            **_gather_blocks(q_idx),
        )
    return out


class _SparseIndexerLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, w_idx, q, kv, indices, softmax_scale, lse):
        target = head_mean_probs(q, kv, indices, softmax_scale, lse)
        scores = indexer_gather_scores(q_idx, k_idx, w_idx, indices)
        valid = indices >= 0
        log_q = torch.log_softmax(scores, dim=-1).masked_fill_(~valid, 0.0)
        loss = (torch.xlogy(target, target) - target * log_q).sum(-1)
        ctx.save_for_backward(q_idx, k_idx, w_idx, indices, target, log_q)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        q_idx, k_idx, w_idx, indices, target, log_q = ctx.saved_tensors
        # d/dI of sum_j p_j (log p_j - log_softmax(I)_j) = softmax(I) * sum_j p_j - p
        prob = log_q.exp().masked_fill_(indices < 0, 0.0)
        dscores = (prob * target.sum(-1, keepdim=True) - target) * dloss[..., None]
        b, s = q_idx.shape[:2]
        dq = torch.empty_like(q_idx)
        dk = torch.zeros(k_idx.shape, dtype=torch.float32, device=k_idx.device)
        dw = torch.empty_like(w_idx)
        if dscores.numel():
            _indexer_gather_bwd[(s, b)](
                q_idx, k_idx, w_idx, indices, dscores, dq, dk, dw, q_idx.shape[2], indices.shape[-1],
                q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
                w_idx.stride(0), w_idx.stride(1), indices.stride(0), indices.stride(1),
                dscores.stride(0), dscores.stride(1), dk.stride(0), dk.stride(1),
                **_gather_blocks(q_idx),
            )
        return dq, dk.to(k_idx.dtype), dw, None, None, None, None, None


def dsa_indexer_loss(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    softmax_scale: float,
    indices: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused ``dsa_indexer_loss`` for the sparse stage; the warm-up (``indices=None``) runs the
    registry's reference. With ``lse`` (the sparse attention's log-sum-exp over the same keys) the
    target takes one pass over the logits, without it two."""
    if indices is None:
        return get_op("dsa_indexer_loss").reference(q_idx, k_idx, w_idx, q, kv, softmax_scale, lse=lse)
    _check_indexer("dsa_indexer_loss", q_idx, k_idx, w_idx)
    b, s = q_idx.shape[:2]
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (b, s) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"dsa_indexer_loss: indices must be int32/int64 [B, S, topk] = [{b}, {s}, k], got "
            f"{indices.dtype} {tuple(indices.shape)}"
        )
    if q_idx.dtype != k_idx.dtype:
        raise ValueError(f"dsa_indexer_loss: q_idx dtype {q_idx.dtype} != k_idx dtype {k_idx.dtype}")
    check_tensors("dsa_indexer_loss", q_idx, k_idx, w_idx, q, kv, indices)
    q_idx, k_idx, w_idx, indices = (_contiguous(t) for t in (q_idx, k_idx, w_idx, indices))
    return _SparseIndexerLoss.apply(q_idx, k_idx, w_idx, q.detach(), kv.detach(), indices, softmax_scale,
                                    None if lse is None else lse.detach())


def indexer_scores_chunk(
    q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, t0: int, t1: int, out: torch.Tensor
) -> torch.Tensor:
    """Causally masked fp32 scores of queries ``[t0, t1)`` against the keys they can see, into ``out``.

    ``out`` is a ``[B, >= t1 - t0, >= width]`` fp32 buffer (last dim contiguous); returns its
    ``[B, t1 - t0, width]`` view, ``width = t1 + S_kv - S`` (keys past the last query are all -inf).
    """
    b, s, h, dim = q_idx.shape
    n_kv = k_idx.shape[1]
    offset = n_kv - s
    width = t1 - 1 + offset + 1
    view = out[:, : t1 - t0, :width]
    _indexer_scores[(triton.cdiv(t1 - t0, BLOCK_M), triton.cdiv(width, BLOCK_N), b)](
        q_idx, k_idx, w_idx, view,
        t0, t1 - t0, width, offset, h,
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
        w_idx.stride(0), w_idx.stride(1), view.stride(0), view.stride(1),
        DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PRECISION=dot_precision(q_idx.dtype), num_warps=4,
    )
    return view


def _check_indexer(op: str, q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor) -> None:
    dims = check_shapes(op, q_idx=(q_idx, "B S HI DI"), k_idx=(k_idx, "B S_kv DI"), w_idx=(w_idx, "B S HI"))
    if dims["S_kv"] < dims["S"]:
        raise ValueError(f"{op}: fewer keys ({dims['S_kv']}) than queries ({dims['S']}); queries are the last keys")


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.no_grad()
def dsa_indexer_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, topk: int) -> torch.Tensor:
    """Fused ``dsa_indexer_topk``: int32 ``[B, S, topk]``, -1 padded."""
    _check_indexer("dsa_indexer_topk", q_idx, k_idx, w_idx)
    if topk < 1:
        raise ValueError(f"dsa_indexer_topk: topk must be >= 1, got {topk}")
    if q_idx.dtype != k_idx.dtype:
        raise ValueError(f"dsa_indexer_topk: q_idx dtype {q_idx.dtype} != k_idx dtype {k_idx.dtype}")
    check_tensors("dsa_indexer_topk", q_idx, k_idx, w_idx)
    q_idx, k_idx, w_idx = _contiguous(q_idx), _contiguous(k_idx), _contiguous(w_idx)
    b, s = q_idx.shape[:2]
    n_kv = k_idx.shape[1]
    out = torch.full((b, s, topk), -1, dtype=torch.int32, device=q_idx.device)
    chunk = max(1, min(s, s * topk // max(1, n_kv)))  # [chunk, keys] fp32 scores: about S * topk elements
    buf = torch.empty((b, chunk, n_kv), dtype=torch.float32, device=q_idx.device)
    for t0 in range(0, s, chunk):
        t1 = min(t0 + chunk, s)
        scores = indexer_scores_chunk(q_idx, k_idx, w_idx, t0, t1, buf)
        vals, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1, sorted=False)
        out[:, t0:t1, : idx.shape[-1]] = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    return out
