"""Lightning-indexer scoring for DSA (Triton) and the top-k selection built on it.

Contract: ``loongforge.core.kernels.dsa.dsa_indexer_topk``. The score of query ``t`` and key ``s``
is ``sum_j w[t, j] * relu(q[t, j] . k[s])`` over the indexer's few heads. The torch reference
forms the ``[queries, heads, keys]`` products before the ReLU-weighted head sum; the kernel keeps
one ``[BLOCK_M, BLOCK_N]`` fp32 tile of the sum in registers and adds one head at a time, so only
the head-summed scores ever reach memory, and key blocks wholly in a query block's future are
skipped (written as -inf). Queries go in chunks whose ``[chunk, keys]`` fp32 scores take about
``S * topk`` elements; each chunk's top-k is ``torch.topk`` over those scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.dsa import _check_indexer, query_chunk
from loongforge.kernels.launch import check_tensors

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
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
        acc += tl.maximum(tl.dot(q, tl.trans(k)), 0.0) * w[:, None]
    acc = tl.where(visible, acc, float("-inf"))
    tl.store(
        OUT + b * stride_ob + rows[:, None].to(tl.int64) * stride_os + cols[None, :], acc,
        mask=row_ok[:, None] & (cols[None, :] < n_cols),
    )


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
        num_warps=4,
    )
    return view


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.no_grad()
def dsa_indexer_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, topk: int) -> torch.Tensor:
    """Fused ``loongforge.core.kernels.dsa.dsa_indexer_topk``: int32 ``[B, S, topk]``, -1 padded."""
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
    chunk = query_chunk(s, n_kv, s * topk)
    buf = torch.empty((b, chunk, n_kv), dtype=torch.float32, device=q_idx.device)
    for t0 in range(0, s, chunk):
        t1 = min(t0 + chunk, s)
        scores = indexer_scores_chunk(q_idx, k_idx, w_idx, t0, t1, buf)
        vals, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1, sorted=False)
        out[:, t0:t1, : idx.shape[-1]] = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    return out
