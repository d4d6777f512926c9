"""DeepSeek-V3.2 sparse attention (DSA): torch references for the lightning indexer and sparse MLA.

DSA replaces dense causal attention by attention over ``topk`` keys per query, chosen by a cheap
*lightning indexer*: a few low-rank heads score every previous token,

    I[t, s] = sum_j w[t, j] * relu(q_idx[t, j] . k_idx[s])          (s <= t)

and each query keeps the ``topk`` best-scoring keys. Attention then runs in MLA's absorbed form
over those keys only: every head of a query shares one latent KV row per key, ``kv = [c_kv, k_rope]``
(``D = d_v + d_rope``), whose first ``d_v`` entries are also the value. During the warm-up stage the
indexer is trained alone, with a KL loss against the (detached) dense attention distribution
summed over heads; in the sparse stage the same loss runs over the selected keys only.

Shapes (one sequence per batch row; queries are the last ``S`` of the ``S_kv`` key positions, so
query ``t`` sees keys ``s <= t + S_kv - S``):

    q_idx [B, S, HI, DI]   k_idx [B, S_kv, DI]   w_idx [B, S, HI]
    q     [B, S, H, D]     kv    [B, S_kv, D]    indices [B, S, topk] int32, -1 = no key

Nothing here materialises an ``S x S`` tensor: queries go in chunks sized so that a chunk's
largest intermediate stays within ``S * topk`` elements (``S * DENSE_CHUNK_KEYS`` for the dense
warm-up loss), and each chunk of a differentiable op is
wrapped in ``torch.utils.checkpoint``, so its backward recomputes that chunk (autograd gives the
exact gradient) instead of keeping every chunk's intermediates alive. These functions define the
contracts of the ops ``dsa_indexer_topk``, ``dsa_indexer_loss``, ``sparse_mla_attention`` and
``sparse_mla_absorbed_attention``
(``loongforge.ops`` entry points of loongforge-llm), which the fused kernels in
``loongforge-kernels`` are tested against; they are slow but correct, and run on any device.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from loongforge.core.kernels.mla_absorbed import absorb_query, check_absorbed  # absorb_query: the DSA attention too
from loongforge.core.kernels.shapes import check_shapes

# The dense warm-up loss has no top-k to bound its chunks: it sizes them as if ``topk`` were this.
DENSE_CHUNK_KEYS = 2048


def query_chunk(n_queries: int, per_query: int, budget: int) -> int:
    """Queries per chunk so that ``per_query`` elements per query stay within ``budget`` elements."""
    return max(1, min(n_queries, budget // max(1, per_query)))


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _causal_mask(t0: int, t1: int, n_kv: int, offset: int, device) -> torch.Tensor:
    """``[t1 - t0, n_kv]``: query ``t`` (absolute row ``t0 + i``) may see key ``s <= t + offset``."""
    rows = torch.arange(t0, t1, device=device)[:, None] + offset
    return torch.arange(n_kv, device=device)[None, :] <= rows


def check_indexer(op: str, q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor) -> None:
    dims = check_shapes(op, q_idx=(q_idx, "B S HI DI"), k_idx=(k_idx, "B S_kv DI"), w_idx=(w_idx, "B S HI"))
    if dims["S_kv"] < dims["S"]:
        raise ValueError(f"{op}: {dims['S_kv']} keys for {dims['S']} queries; queries must be the last S key positions")


def check_attention(op: str, q: torch.Tensor, kv: torch.Tensor, d_v: int) -> None:
    dims = check_shapes(op, q=(q, "B S H D"), kv=(kv, "B S_kv D"))
    if not 0 < d_v <= dims["D"]:
        raise ValueError(f"{op}: d_v={d_v} must be in (0, D={dims['D']}]")


def indexer_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor) -> torch.Tensor:
    """``sum_j w[b,t,j] * relu(q_idx[b,t,j] . k_idx[b,s])`` for every pair, fp32 ``[B, S, S_kv]`` (unmasked).

    ``k_idx`` may also be per query, ``[B, S, K, DI]`` (gathered keys): then the result is ``[B, S, K]``.
    """
    q, w = q_idx.float(), w_idx.float()
    if k_idx.dim() == 4:
        z = torch.einsum("bthd,btkd->bthk", q, k_idx.float())
    else:
        z = torch.einsum("bthd,bsd->bths", q, k_idx.float())
    return torch.einsum("bths,bth->bts", z.relu(), w)


def _gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[b, indices[b, t, j]]`` as ``[B, S, K, D]`` (index -1 reads row 0; callers mask it)."""
    b, n, d = x.shape
    flat = (indices.clamp_min(0).long() + torch.arange(b, device=x.device)[:, None, None] * n).reshape(-1)
    return x.reshape(b * n, d)[flat].view(*indices.shape, d)


@torch.no_grad()
def dsa_indexer_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` causal keys with the highest lightning-indexer score, per query.

    Returns int32 ``[B, S, topk]`` key positions; a query with fewer than ``topk`` visible keys pads
    its row with -1. Scores are computed in fp32. Of keys with equal scores (ReLU makes exact zeros
    common) the earlier ones are kept, so the selection does not depend on how many keys or
    queries a call covers (context parallelism calls it per query chunk); a fused kernel may
    break such ties differently.
    """
    check_indexer("dsa_indexer_topk", q_idx, k_idx, w_idx)
    if topk < 1:
        raise ValueError(f"dsa_indexer_topk: topk must be >= 1, got {topk}")
    b, s, h, _ = q_idx.shape
    n_kv = k_idx.shape[1]
    offset = n_kv - s
    out = torch.full((b, s, topk), -1, dtype=torch.int32, device=q_idx.device)
    k_f = k_idx.float()
    for t0, t1 in _chunks(s, query_chunk(s, h * n_kv, s * topk)):
        width = t1 - 1 + offset + 1  # keys past the chunk's last query are never visible
        scores = indexer_scores(q_idx[:, t0:t1], k_f[:, :width], w_idx[:, t0:t1])
        scores.masked_fill_(~_causal_mask(t0, t1, width, offset, q_idx.device), float("-inf"))
        # a stable sort, so that among equal scores the earlier key wins however many keys the row has
        vals, idx = (t[..., : min(topk, width)] for t in scores.sort(dim=-1, descending=True, stable=True))
        out[:, t0:t1, : idx.shape[-1]] = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    return out


def _sparse_attention_chunk(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA for one chunk of queries, in fp32: softmax over the valid gathered keys. Returns
    the output and the log-sum-exp of the logits (no grad; +inf for a query with no valid key)."""
    sel = _gather_rows(kv, indices).float()  # [B, C, K, D]
    logits = torch.einsum("bchd,bckd->bchk", q.float(), sel) * softmax_scale
    logits = logits.masked_fill((indices < 0)[:, :, None, :], float("-inf"))
    # softmax that gives 0 (not NaN) for a query with no valid key
    row_max = logits.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
    e = torch.exp(logits - row_max)
    p = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    lse = torch.logsumexp(logits.detach(), dim=-1)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return torch.einsum("bchk,bckd->bchd", p, sel[..., :d_v]).to(q.dtype), lse


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, softmax_scale: float, d_v: int, return_lse: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA attention (absorbed form, one shared latent KV head) over the keys in ``indices``.

    ``out[b, t, h] = sum_j p_j * kv[b, idx_j, :d_v]`` with ``p = softmax_j(softmax_scale *
    q[b, t, h] . kv[b, idx_j])`` over the valid (``>= 0``) entries ``idx_j = indices[b, t, j]``;
    a query with no valid entry gets 0. Repeated indices count once per entry. Returns
    ``[B, S, H, d_v]`` in ``q``'s dtype; grads flow to ``q`` and ``kv``. With ``return_lse``,
    ``(out, lse)``: ``lse[b, t, h] = log sum_j exp(softmax_scale * q[b, t, h] . kv[b, idx_j])``
    over the same entries, fp32 ``[B, S, H]``, natural log, +inf for a query with no valid entry,
    without grad (what ``dsa_indexer_loss`` takes to skip recomputing it).
    """
    check_attention("sparse_mla_attention", q, kv, d_v)
    b, s, h, d = q.shape
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (b, s):
        raise ValueError(f"sparse_mla_attention: indices must be [B, S, topk] = [{b}, {s}, k], got {tuple(indices.shape)}")
    topk = indices.shape[-1]
    chunk = query_chunk(s, topk * max(h, d), s * topk)
    outs, lses = zip(*(
        checkpoint(_sparse_attention_chunk, q[:, t0:t1], kv, indices[:, t0:t1], softmax_scale, d_v, use_reentrant=False)
        for t0, t1 in _chunks(s, chunk)
    ))
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lses, dim=1)) if return_lse else out


def _absorbed_attention_chunk(q_nope, q_rope, kv, indices, w_uk, w_uv, softmax_scale):
    q = absorb_query(q_nope, q_rope, w_uk)
    o_lat, lse = _sparse_attention_chunk(q, kv, indices, softmax_scale, w_uk.shape[-1])
    return torch.einsum("bshc,hvc->bshv", o_lat, w_uv), lse


def sparse_mla_absorbed_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    softmax_scale: float,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA from the per-head query to the per-head output, with the absorption inside the op.

    ``out[b, t, h] = w_uv[h] @ sparse_mla_attention(absorb_query(q_nope, q_rope, w_uk), kv, indices,
    softmax_scale, C)[b, t, h]``: queries ``q_nope`` ``[B, S, H, DN]`` and ``q_rope`` ``[B, S, H, DR]``,
    latent rows ``kv`` ``[B, S_kv, C + DR]``, the key up-projection ``w_uk`` ``[H, DN, C]`` and the
    value up-projection ``w_uv`` ``[H, DV, C]``; returns ``[B, S, H, DV]``. Grads flow to all five
    tensors. The op owns the ``[B, S, H, C + DR]`` absorbed queries and ``[B, S, H, C]`` latent
    outputs, so an implementation may keep them per chunk of queries only (they are 3-4x the size of
    the per-head query and output at DeepSeek's sizes). With ``return_lse``, ``(out, lse)``: the
    attention's log-sum-exp over the selected keys, as ``sparse_mla_attention`` returns it.
    """
    dims = check_absorbed("sparse_mla_absorbed_attention", q_nope, q_rope, kv, indices, w_uk, w_uv)
    s = dims["S"]
    chunk = query_chunk(s, indices.shape[-1] * max(dims["H"], dims["D"]), s * indices.shape[-1])
    outs, lses = zip(*(
        checkpoint(_absorbed_attention_chunk, q_nope[:, t0:t1], q_rope[:, t0:t1], kv, indices[:, t0:t1], w_uk, w_uv,
                   softmax_scale, use_reentrant=False)
        for t0, t1 in _chunks(s, chunk)
    ))
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lses, dim=1)) if return_lse else out


def _kl(p: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_s p * (log p - log_softmax(logits))`` over the ``mask``ed entries of the last dim."""
    log_q = torch.log_softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).masked_fill(~mask, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1)


def _head_mean_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``[B, C, H, K]`` (masked to ``mask`` ``[B|1, C, 1, K]``) summed over heads, L1-normalised."""
    p = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return p.mean(2)


def _indexer_kl_dense_chunk(q_idx, k_idx, w_idx, q, kv, softmax_scale, t0, offset):
    t1 = t0 + q_idx.shape[1]
    width = t1 - 1 + offset + 1
    mask = _causal_mask(t0, t1, width, offset, q.device)[None]  # [1, C, width]
    with torch.no_grad():
        logits = torch.einsum("bchd,bsd->bchs", q.float(), kv[:, :width].float()) * softmax_scale
        target = _head_mean_softmax(logits, mask[:, :, None, :])
    scores = indexer_scores(q_idx, k_idx[:, :width], w_idx)
    return _kl(target, scores, mask)


def _indexer_kl_sparse_chunk(q_idx, k_idx, w_idx, q, kv, indices, softmax_scale):
    mask = indices >= 0  # [B, C, K]
    with torch.no_grad():
        sel = _gather_rows(kv, indices).float()
        logits = torch.einsum("bchd,bckd->bchk", q.float(), sel) * softmax_scale
        target = _head_mean_softmax(logits, mask[:, :, None, :])
    scores = indexer_scores(q_idx, _gather_rows(k_idx, indices), w_idx)
    return _kl(target, scores, mask)


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
    """The lightning indexer's KL loss, per query: fp32 ``[B, S]``.

    ``KL(p_t || softmax_s(I[t, s]))`` where ``p_t`` is the main attention distribution of query
    ``t`` (``softmax(softmax_scale * q . kv)`` per head, summed over heads and L1-normalised),
    computed without grad: ``q`` and ``kv`` get none, the indexer inputs ``q_idx``, ``k_idx``,
    ``w_idx`` do. With ``indices=None`` (the dense warm-up stage) both distributions range over
    every causal key; with ``indices`` (the sparse stage) over the selected keys only.

    ``lse`` (sparse stage only): the log-sum-exp of the same attention over the same selected keys,
    fp32 ``[B, S, H]``, as ``sparse_mla_attention(q, kv, indices, softmax_scale, d_v,
    return_lse=True)`` returns it. It does not change the loss: an implementation may take each
    head's softmax normaliser from it instead of recomputing it (one pass over the logits instead
    of two); this reference checks its shape and recomputes the normaliser.
    """
    check_indexer("dsa_indexer_loss", q_idx, k_idx, w_idx)
    check_attention("dsa_indexer_loss", q, kv, q.shape[-1])
    b, s, hi, _ = q_idx.shape
    h, n_kv = q.shape[2], kv.shape[1]
    if tuple(q.shape[:2]) != (b, s) or k_idx.shape[1] != n_kv:
        raise ValueError(
            f"dsa_indexer_loss: indexer {tuple(q_idx.shape)}/{tuple(k_idx.shape)} and attention "
            f"{tuple(q.shape)}/{tuple(kv.shape)} inputs describe different sequences"
        )
    if lse is not None:
        if indices is None:
            raise ValueError("dsa_indexer_loss: lse is the sparse attention's over the selected keys; give indices with it")
        check_shapes("dsa_indexer_loss", q=(q, "B S H D"), lse=(lse, "B S H"))
    losses = []
    if indices is None:
        chunk = query_chunk(s, max(h, hi) * n_kv, s * DENSE_CHUNK_KEYS)
        for t0, t1 in _chunks(s, chunk):
            losses.append(checkpoint(
                _indexer_kl_dense_chunk, q_idx[:, t0:t1], k_idx, w_idx[:, t0:t1], q[:, t0:t1], kv,
                softmax_scale, t0, n_kv - s, use_reentrant=False,
            ))
    else:
        if indices.dim() != 3 or tuple(indices.shape[:2]) != (b, s):
            raise ValueError(f"dsa_indexer_loss: indices must be [B, S, topk] = [{b}, {s}, k], got {tuple(indices.shape)}")
        topk = indices.shape[-1]
        chunk = query_chunk(s, topk * max(h, hi, q.shape[-1]), s * topk)
        for t0, t1 in _chunks(s, chunk):
            losses.append(checkpoint(
                _indexer_kl_sparse_chunk, q_idx[:, t0:t1], k_idx, w_idx[:, t0:t1], q[:, t0:t1], kv,
                indices[:, t0:t1], softmax_scale, use_reentrant=False,
            ))
    return torch.cat(losses, dim=1)
