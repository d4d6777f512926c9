"""DeepSeek sparse attention (DSA) under context parallelism: the whole sequence's key state on
every CP rank, and which keys each local query chunk sees.

Under ``parallel.cp > 1`` every sequence is cut into ``2 * cp`` equal chunks and CP rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` (``layers.context_parallel_attention``). A DSA query
picks its keys by the indexer's top-k over *every* earlier key of its sequence, so each rank
all-gathers the per-token key state over the CP group, which in DSA is small: MLA's latent row
(``kv_lora_rank + qk_rope_head_dim`` values, in the absorbed form both the key and the value) and
the indexer's key (``dsa_indexer_head_dim`` values). The gather is megatron's
``gather_from_sequence_parallel_region`` (``context_parallel_attention.gather_kv``): its backward
reduce-scatters the gradient, so every rank's contribution to a key reaches the rank that owns it.
The gathered rows are put back in natural order, and local query chunk ``j`` (global rows
``[j*c, (j+1)*c)``) runs against keys ``[0, (j+1)*c)``: the layout the registry's DSA ops take
(queries are the last rows of the keys), so each query scores exactly the keys it scores on one
process.
"""

from __future__ import annotations

import torch

from loongforge.llm.layers.context_parallel_attention import gather_kv, natural_order, zigzag_chunks, zigzag_index


def gather_sequence(local: torch.Tensor, cp_group) -> torch.Tensor:
    """The whole sequences' rows ``[s, ...]`` in natural order, from this rank's ``[s_local, ...]``
    (its two zigzag chunks) on every rank of ``cp_group``; the backward returns each rank the
    gradient of its own rows, summed over the group."""
    cp_size, s_local = cp_group.size(), local.shape[0]
    order = natural_order([zigzag_index(s_local * cp_size, cp_size, r, local.device) for r in range(cp_size)])
    return gather_kv(local.contiguous(), cp_group).index_select(0, order)


def query_chunks(s_local: int, cp_size: int, cp_rank: int) -> list[tuple[int, int, int]]:
    """``(start, end, keys)`` per contiguous run of this rank's ``s_local`` query rows: local rows
    ``[start, end)`` are the last ``end - start`` of the sequence's first ``keys`` positions.
    One process: the whole sequence."""
    if cp_size == 1:
        return [(0, s_local, s_local)]
    c = s_local // 2
    return [(part * c, (part + 1) * c, (j + 1) * c) for part, j in enumerate(zigzag_chunks(cp_size, cp_rank))]
