"""Context parallelism (CP) for the fast path's SDPA attention, without Transformer Engine.

**The split.** Each sequence is cut into ``2 * cp`` equal chunks and CP rank ``r`` keeps chunks
``r`` and ``2 * cp - 1 - r`` (megatron's causal load balancing: every rank gets one early and one
late chunk, so the causal work is even). Dense ``[b, s]`` batches are split by megatron-core's
``get_batch_on_this_cp_rank``; a packed (THD) row is split the same way segment by segment, each
segment padded to a multiple of ``2 * cp`` first (``thd_zigzag_index``: what Transformer Engine's
``thd_get_partitioned_indices`` computes for megatron, written here so it runs without TE). The
packed row's ``PackedSeqParams`` keep the whole row's ``cu_seqlens`` (``cu_seqlens_q_padded``:
the padded segment bounds), as megatron hands them to TE.

**RoPE** uses each local token's global position (``local_positions``): ``rope_tables`` takes the
rows of the whole sequence's angle table at those positions.

**Attention** (megatron's ``cp_comm_type="all_gather"``): every rank all-gathers the keys and
values of the CP group (megatron's ``gather_from_sequence_parallel_region``: its backward
reduce-scatters dK/dV, summing every rank's contribution), puts them back in natural order and
computes each local query chunk ``j`` (global rows ``[j*c, (j+1)*c)`` of its sequence or segment)
against keys ``[0, (j+1)*c)``, causal on the diagonal (``chunk_attention``: one causal SDPA call
whose queries are the last ``c`` rows of the keys, which ``attention.SDPAttention`` hands SDPA as
torch's lower-right causal bias, so the flash and cuDNN kernels still serve it). Grouped-query attention gathers only the
``num_query_groups`` K/V heads.

**The layout** of the gathered rows (the permutation back to natural order; a packed row's bounds
as numbers, a host read) is a ``GatheredLayout`` the caller hands in: a packed row's comes with its
forward's ``PackedSeqParams`` (``packed_params``), so the first layer computes it and the others
reuse it; nothing is kept between forwards.

Later optimisation, not done here: a ring exchange of K/V blocks (megatron's ``p2p``), overlapping
the transfer with the attention of the block at hand and merging the partial outputs by their
log-sum-exp, which keeps one block of remote K/V in memory instead of the whole sequence's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

# sdpa(q, k, v, mask, causal) on [b, heads, s, d] views; mask: True = attend; causal with fewer queries
# than keys aligns the queries with the last keys (lower-right)
SDPA = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp_size``) CP rank ``cp_rank`` keeps."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_index(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of CP rank ``cp_rank``'s tokens of a sequence of ``length`` positions, in
    the rank's local order (chunk ``r``, then chunk ``2 * cp_size - 1 - r``)."""
    if length % (2 * cp_size):
        raise ValueError(f"a sequence of {length} positions does not split into 2*cp = {2 * cp_size} equal chunks")
    c = length // (2 * cp_size)
    a, b = zigzag_chunks(cp_size, cp_rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def thd_zigzag_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row positions of CP rank ``cp_rank``'s tokens of a packed row whose segments start at
    ``cu_seqlens_padded`` (each a multiple of ``2 * cp_size`` long): per segment, its chunks ``r``
    and ``2 * cp_size - 1 - r``, segment after segment. Computed on ``cu_seqlens_padded``'s device
    without reading it back."""
    cu = cu_seqlens_padded.long()
    local_cu = cu // cp_size
    tokens = torch.arange(int(local_cu[-1]), device=cu.device)  # the row length: one read of cu
    segment = torch.searchsorted(local_cu[1:].contiguous(), tokens, right=True)
    offset = tokens - local_cu[segment]  # position among the rank's 2c tokens of the segment
    c = (cu[segment + 1] - cu[segment]) // (2 * cp_size)
    first, second = zigzag_chunks(cp_size, cp_rank)
    early = offset < c
    return cu[segment] + torch.where(early, first * c + offset, second * c + offset - c)


def check_thd_padding(cu_seqlens_padded: Sequence[int], cp_size: int) -> None:
    bounds = list(cu_seqlens_padded)
    bad = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if (b - a) % (2 * cp_size)]
    if bad:
        raise ValueError(f"context parallelism needs every packed segment padded to a multiple of 2*cp = "
                         f"{2 * cp_size} positions; got segment lengths {bad}")


def local_positions(length_local: int, cp_size: int, cp_rank: int, cu_seqlens_padded: torch.Tensor | None,
                    device=None) -> torch.Tensor:
    """Each local token's RoPE position: its position in its sequence (dense, ``length_local``
    tokens per sequence on this rank) or in its packed segment (``cu_seqlens_padded``)."""
    if cu_seqlens_padded is None:
        return zigzag_index(length_local * cp_size, cp_size, cp_rank, device)
    cu = cu_seqlens_padded.long()
    rows = thd_zigzag_index(cu, cp_size, cp_rank)
    segment = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
    return rows - cu[segment]


def natural_order(indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """The permutation that puts the rank-major concatenation of every rank's tokens
    (``indices[r]``: rank ``r``'s global positions) back in natural order."""
    gathered = torch.cat(list(indices))
    order = torch.empty_like(gathered)
    order[gathered] = torch.arange(gathered.numel(), device=gathered.device)
    return order


def split_packed(batch: dict, cp_size: int, cp_rank: int, keys: Sequence[str]) -> dict:
    """CP rank ``cp_rank``'s share of a packed ``[1, T]`` row (``cu_seqlens_padded`` bounds); other
    entries are kept as they are."""
    index = thd_zigzag_index(batch["cu_seqlens_padded"], cp_size, cp_rank).to(batch[keys[0]].device)
    return {k: (v.index_select(1, index) if k in keys else v) for k, v in batch.items()}


def chunk_attention(sdpa: SDPA, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int):
    """Causal attention of ``query`` (``[b, h, c, d]``, global rows ``[offset, offset + c)``) against
    ``key``/``value`` rows ``[0, offset + c)``: every key before ``offset``, and the diagonal block."""
    c = query.shape[-2]
    if key.shape[-2] != offset + c:
        raise ValueError(f"chunk at {offset} of {c} rows needs {offset + c} keys, got {key.shape[-2]}")
    return sdpa(query, key, value, None, True)  # causal with fewer queries than keys: aligned to the last key


def dense_local_attention(sdpa: SDPA, query, key_full, value_full, cp_size: int, cp_rank: int):
    """This rank's attention output for its local queries ``[s_local, b, h, d]`` against the whole
    sequences' keys/values ``[s, b, g, d]`` in natural order; ``[s_local, b, h, d]``."""
    s_local = query.shape[0]
    c = s_local // 2
    if key_full.shape[0] != s_local * cp_size:
        raise ValueError(f"{s_local} local queries per sequence need {s_local * cp_size} keys, got {key_full.shape[0]}")
    q = query.permute(1, 2, 0, 3)
    k, v = key_full.permute(1, 2, 0, 3), value_full.permute(1, 2, 0, 3)
    outs = []
    for part, j in enumerate(zigzag_chunks(cp_size, cp_rank)):
        end = (j + 1) * c
        outs.append(chunk_attention(sdpa, q[:, :, part * c : (part + 1) * c], k[:, :, :end], v[:, :, :end], j * c))
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3)


def packed_local_attention(sdpa: SDPA, query, key_full, value_full, cu_seqlens_padded: Sequence[int], cp_size: int,
                           cp_rank: int):
    """THD: this rank's local queries ``[t_local, h, d]`` against the whole row's keys/values
    ``[t, g, d]`` (natural order), each segment only within itself; ``[t_local, h, d]``."""
    bounds = list(cu_seqlens_padded)
    check_thd_padding(bounds, cp_size)
    if bounds[0] != 0 or bounds[-1] != key_full.shape[0] or bounds[-1] // cp_size != query.shape[0]:
        raise ValueError(f"cu_seqlens_padded {bounds} must run from 0 to the {key_full.shape[0]} packed positions "
                         f"({query.shape[0]} on each of the {cp_size} CP ranks)")
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        c = (end - start) // (2 * cp_size)
        local = start // cp_size
        for part, j in enumerate(zigzag_chunks(cp_size, cp_rank)):
            q = query[local + part * c : local + (part + 1) * c].transpose(0, 1)[None]
            k = key_full[start : start + (j + 1) * c].transpose(0, 1)[None]
            v = value_full[start : start + (j + 1) * c].transpose(0, 1)[None]
            outs.append(chunk_attention(sdpa, q, k, v, j * c)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def gather_kv(tensor: torch.Tensor, cp_group) -> torch.Tensor:
    """All-gather ``tensor`` along dim 0 over ``cp_group`` (rank-major); the backward reduce-scatters."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=cp_group)


class GatheredLayout:
    """How the CP group's gathered rows lie: made from ``cu_seqlens_padded`` (a packed row's
    whole-row padded segment bounds) or ``None`` (dense sequences), it computes on first use, and
    then keeps, what the layers need of that layout: the bounds as numbers (a host read), the
    permutation that puts the gathered rows in natural order, and any other value a caller keys in
    ``cached``. A packed row's layout lives on its forward's ``PackedSeqParams``
    (``packed_params.ForwardPackedSeqParams``), so each forward computes these once for all its
    layers and no forward sees another's; a dense one (no host read) is made per layer call, so its
    order (a few small device ops, shared by the layer's K and V) is recomputed in every layer."""

    def __init__(self, cu_seqlens_padded: torch.Tensor | None = None):
        self.cu_seqlens_padded = cu_seqlens_padded
        self._values: dict[Hashable, object] = {}  # key -> the value computed for it

    def cached(self, key: Hashable, compute: Callable[[], object]):
        """``compute()``, called the first time ``key`` is asked for; the same object after that."""
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]

    def bounds(self) -> list[int]:
        """The packed row's ``cu_seqlens_padded`` as numbers (a dense layout has none)."""
        if self.cu_seqlens_padded is None:
            raise RuntimeError("GatheredLayout.bounds: a dense layout (no cu_seqlens_padded) has no packed bounds")
        return self.cached("bounds", self.cu_seqlens_padded.tolist)

    def order(self, n_local: int, cp_size: int, device) -> torch.Tensor:
        """The permutation (on ``device``) that puts the rank-major all-gather of ``n_local`` rows
        from each of ``cp_size`` ranks back in natural order."""
        return self.cached(("order", n_local, cp_size, device),
                           lambda: natural_order(self._rank_positions(n_local, cp_size, device)))

    def _rank_positions(self, n_local: int, cp_size: int, device) -> list[torch.Tensor]:
        """Every CP rank's rows as global positions, rank after rank (``natural_order``'s input)."""
        if self.cu_seqlens_padded is None:
            return [zigzag_index(n_local * cp_size, cp_size, r, device) for r in range(cp_size)]
        return [thd_zigzag_index(self.cu_seqlens_padded, cp_size, r).to(device) for r in range(cp_size)]


def context_parallel_attention(sdpa: SDPA, query, key, value, cp_group, layout: GatheredLayout):
    """Causal attention of this CP rank's tokens over the whole sequences of the CP group.

    Dense (``layout`` of no bounds): ``query`` ``[s_local, b, h, d]``, ``key``/``value``
    ``[s_local, b, g, d]``; packed (``layout`` of the whole row's padded segment bounds):
    ``[t_local, heads, d]``. Returns the attention output in the layout of ``query``."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    key_full = gather_in_order(key, cp_group, layout)
    value_full = gather_in_order(value, cp_group, layout)
    if layout.cu_seqlens_padded is None:
        return dense_local_attention(sdpa, query, key_full, value_full, cp_size, cp_rank)
    return packed_local_attention(sdpa, query, key_full, value_full, layout.bounds(), cp_size, cp_rank)


def gather_in_order(local: torch.Tensor, cp_group, layout: GatheredLayout) -> torch.Tensor:
    """The CP group's whole sequences (or packed row), natural order (``layout``), from this rank's
    share ``local`` (rows on dim 0) on every rank of ``cp_group``; the backward returns each rank
    the gradient of its own rows, summed over the group (``gather_kv``)."""
    order = layout.order(local.shape[0], cp_group.size(), local.device)
    return gather_kv(local.contiguous(), cp_group).index_select(0, order)
