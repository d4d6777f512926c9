"""Sparse MLA from per-head queries to per-head outputs, absorbed in chunks of queries.

Contract: ``sparse_mla_absorbed_attention`` (loongforge-llm's ``loongforge.llm.ops.dsa``). In
MLA's absorbed form each head's query is mapped into the latent space (``q_nope @ w_uk``, 512 wide
at DeepSeek's sizes, plus the 64 rope dims) and each head's output comes back from it
(``o_lat @ w_uv^T``, 512 to 128). Done on the whole sequence, the ``[S, H, 576]`` absorbed queries
and their grad, and the ``[S, H, 512]`` grad of the latent output, are each 3-4x the per-head
tensors dense attention keeps (4.5 GiB each at 32K tokens and 128 heads, in bf16).

Here the queries go in chunks (about ``CHUNK_ELEMENTS`` absorbed-query elements each): a chunk's
absorbed queries are made (written by their GEMM into one buffer the chunks share), attended with ``sparse_mla.attention_forward`` and mapped back; only the
latent output (``w_uv``'s grad needs it) and the log-sum-exp are kept for the backward; with
``return_lse`` the log-sum-exp is returned too, for the indexer loss's one-pass target. The
backward makes each chunk's absorbed queries again (one small GEMM), runs
``sparse_mla.attention_backward`` on the chunk, which adds its key/value grad into one fp32 buffer
for the whole sequence, and adds the chunk's share of the up-projections' grads (fp32).
"""

from __future__ import annotations

import torch

from loongforge.core.kernels.mla_absorbed import absorb_query, check_absorbed
from loongforge.kernels.launch import check_tensors
from loongforge.kernels.sparse_mla import LN2, attention_backward, attention_forward

# Absorbed-query elements per chunk: 2**28 (512 MiB in bf16), about 3.6K tokens at 128 heads x 576
CHUNK_ELEMENTS = 1 << 28


def _chunk_tokens(n_heads: int, row: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, n_heads * row))


def _absorbed_chunks(q_nope, q_rope, w_uk, chunk):
    """``(t0, t1, absorbed queries of tokens t0:t1)`` per chunk, each written into one buffer that
    the chunks share (the next chunk overwrites it)."""
    b, s, h, _ = q_nope.shape
    row = w_uk.shape[-1] + q_rope.shape[-1]
    buffer = torch.empty(b * min(chunk, s) * h * row, dtype=q_nope.dtype, device=q_nope.device)
    for t0 in range(0, s, chunk):
        t1 = min(t0 + chunk, s)
        q = buffer[: b * (t1 - t0) * h * row].view(b, t1 - t0, h, row)
        yield t0, t1, absorb_query(q_nope[:, t0:t1], q_rope[:, t0:t1], w_uk, out=q)


class _AbsorbedSparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_nope, q_rope, kv, indices, w_uk, w_uv, softmax_scale, chunk, return_lse):
        b, s, h, _ = q_nope.shape
        d_c, d_v = w_uk.shape[-1], w_uv.shape[1]
        o_lat = torch.empty((b, s, h, d_c), dtype=q_nope.dtype, device=q_nope.device)
        lse = torch.empty((b, s, h), dtype=torch.float32, device=q_nope.device)
        out = torch.empty((b, s, h, d_v), dtype=q_nope.dtype, device=q_nope.device)
        for t0, t1, q in _absorbed_chunks(q_nope, q_rope, w_uk, chunk):
            attention_forward(q, kv, indices[:, t0:t1], softmax_scale, d_c, out=o_lat[:, t0:t1], lse=lse[:, t0:t1])
            out[:, t0:t1] = torch.einsum("bshc,hvc->bshv", o_lat[:, t0:t1], w_uv)
        ctx.save_for_backward(q_nope, q_rope, kv, indices, w_uk, w_uv, o_lat, lse)
        ctx.softmax_scale, ctx.chunk = softmax_scale, chunk
        if not return_lse:
            return out
        natural_lse = lse * LN2  # the contract's natural log (+inf stays +inf)
        ctx.mark_non_differentiable(natural_lse)
        return out, natural_lse

    @staticmethod
    def backward(ctx, dout, *_lse_grad):
        q_nope, q_rope, kv, indices, w_uk, w_uv, o_lat, lse = ctx.saved_tensors
        s, d_c = q_nope.shape[1], w_uk.shape[-1]
        dq_nope, dq_rope = torch.empty_like(q_nope), torch.empty_like(q_rope)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dw_uk = torch.zeros(w_uk.shape, dtype=torch.float32, device=w_uk.device)
        dw_uv = torch.zeros(w_uv.shape, dtype=torch.float32, device=w_uv.device)
        for t0, t1, q in _absorbed_chunks(q_nope, q_rope, w_uk, ctx.chunk):
            do = dout[:, t0:t1]
            do_lat = torch.einsum("bshv,hvc->bshc", do, w_uv)
            dq = attention_backward(q, kv, indices[:, t0:t1], o_lat[:, t0:t1], lse[:, t0:t1], do_lat,
                                    ctx.softmax_scale, d_c, dkv)
            del do_lat
            dq_lat = dq[..., :d_c]
            dq_nope[:, t0:t1] = torch.einsum("bshc,hdc->bshd", dq_lat, w_uk)
            dq_rope[:, t0:t1] = dq[..., d_c:]
            dw_uk += torch.einsum("bshd,bshc->hdc", q_nope[:, t0:t1], dq_lat)
            del dq, dq_lat  # (else the chunk's query grad would live on beside the next chunk's)
            dw_uv += torch.einsum("bshv,bshc->hvc", do, o_lat[:, t0:t1])
        return (dq_nope, dq_rope, dkv.to(kv.dtype), None, dw_uk.to(w_uk.dtype), dw_uv.to(w_uv.dtype), None, None, None)


def sparse_mla_absorbed_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
    return_lse: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused ``sparse_mla_absorbed_attention``; with ``return_lse`` also the attention's log-sum-exp
    (natural log, fp32 ``[B, S, H]``, +inf for a query with no valid key, no grad);
    ``chunk_elements``: absorbed-query elements per chunk."""
    dims = check_absorbed("sparse_mla_absorbed_attention", q_nope, q_rope, kv, indices, w_uk, w_uv)
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla_absorbed_attention: indices must be int32 or int64, got {indices.dtype}")
    if len({t.dtype for t in (q_nope, q_rope, kv, w_uk, w_uv)}) != 1:
        raise ValueError("sparse_mla_absorbed_attention: q_nope, q_rope, kv, w_uk and w_uv must share one dtype")
    check_tensors("sparse_mla_absorbed_attention", q_nope, q_rope, kv, indices, w_uk, w_uv)
    kv, indices = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, indices))
    chunk = _chunk_tokens(dims["H"], dims["D"], chunk_elements)
    return _AbsorbedSparseMLA.apply(q_nope, q_rope, kv, indices, w_uk, w_uv, softmax_scale, chunk, return_lse)
