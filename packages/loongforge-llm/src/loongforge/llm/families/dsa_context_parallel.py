"""DeepSeek sparse attention (DSA) under context parallelism and on packed rows: the key state
each query needs, and which keys each run of local queries sees.

Under ``parallel.cp > 1`` every sequence is cut into ``2 * cp`` equal chunks and CP rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` (``layers.context_parallel_attention``); a packed (THD)
SFT row is cut the same way segment by segment, each segment padded to a multiple of ``2 * cp``
first (``cu_seqlens_padded``). A DSA query picks its keys by the indexer's top-k over *every*
earlier key of its sequence (its own segment in a packed row), so each rank all-gathers the
per-token key state over the CP group, which in DSA is small: MLA's latent row (``kv_lora_rank +
qk_rope_head_dim`` values, in the absorbed form both the key and the value) and the indexer's key
(``dsa_indexer_head_dim`` values). The gather is ``context_parallel_attention.gather_in_order``
(megatron's ``gather_from_sequence_parallel_region``, then natural order): its backward
reduce-scatters the gradient, so every rank's contribution to a key reaches the rank that owns it.

``query_pieces`` then lists the runs of local query rows and the key rows they see: local query
chunk ``j`` of a sequence or segment starting at row ``k0`` (global rows ``[k0 + j*c, k0 +
(j+1)*c)``) runs against keys ``[k0, k0 + (j+1)*c)``, the layout the registry's DSA ops take
(queries are the last rows of the keys), so each query scores exactly the keys it scores on one
process and no key of another packed sequence. On one process a dense batch is one piece and a
packed row one piece per segment.

The padding CP adds to each packed segment (after its last real token, so causal attention keeps
it from every real query) is left out of the indexer loss (``real_query_rows``): one process has
no such queries.
"""

from __future__ import annotations

import torch

from loongforge.llm.layers.context_parallel_attention import check_thd_padding, thd_zigzag_index, zigzag_chunks


def query_pieces(s_local: int, cp_size: int, cp_rank: int, bounds: list[int] | None = None) -> list[tuple[int, int, int, int]]:
    """``(t0, t1, k0, k1)`` per contiguous run of this rank's ``s_local`` query rows, in row order:
    local rows ``[t0, t1)`` are the last ``t1 - t0`` of the gathered (natural-order) key rows
    ``[k0, k1)``, which are the causal keys of those queries. ``bounds``: a packed row's segment
    bounds (its whole row's ``cu_seqlens_padded`` under CP), each segment only within itself."""
    if bounds is None:
        if cp_size == 1:
            return [(0, s_local, 0, s_local)]
        c = s_local // 2
        return [(part * c, (part + 1) * c, 0, (j + 1) * c) for part, j in enumerate(zigzag_chunks(cp_size, cp_rank))]
    if bounds[0] != 0 or bounds[-1] != s_local * cp_size:
        raise ValueError(f"packed segment bounds {bounds} must run from 0 to the {s_local * cp_size} packed positions "
                         f"({s_local} on each of the {cp_size} CP ranks)")
    if cp_size == 1:
        return [(start, end, start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    check_thd_padding(bounds, cp_size)
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        c, local = (end - start) // (2 * cp_size), start // cp_size
        pieces += [(local + part * c, local + (part + 1) * c, start, start + (j + 1) * c)
                   for part, j in enumerate(zigzag_chunks(cp_size, cp_rank)) if c]
    return pieces


def real_query_rows(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[t_local]`` bool: which of this rank's rows of a packed row are real tokens (not the
    padding up to ``cu_seqlens_padded`` after each sequence's own ``cu_seqlens`` length)."""
    cu, padded = cu_seqlens.long(), cu_seqlens_padded.long().to(cu_seqlens.device)
    rows = thd_zigzag_index(padded, cp_size, cp_rank)
    segment = torch.searchsorted(padded[1:].contiguous(), rows, right=True)
    return rows - padded[segment] < cu[segment + 1] - cu[segment]
