"""cos/sin tables for the registry's ``rope`` op, from megatron's rotary embedding angles.

megatron's ``RotaryEmbedding`` hands every layer the same ``[s, 1, 1, rot_dim]`` fp32 angle tensor
(``cat(freqs, freqs)``, rotate-half layout). The fused ``rope`` op wants one ``cos``/``sin`` row per
token of ``x``'s leading dims; building those rows once per forward and sharing them across
layers (and between queries and keys) keeps the expansion out of every layer: a ``RopeTables``
belongs to one model (``self_attention.share_rope_tables``), not to the process. Packed (THD)
batches gather each token's row at its position inside its own ``cu_seqlens`` segment, as
megatron's THD rotary does. Under context parallelism (``cp``: the CP group's size and this
rank's index) the angle table is the whole sequence's and each local token takes the row of its
global position (``context_parallel_attention.local_positions``); a packed row's positions (a host
read of its bounds) are kept on its forward's ``GatheredLayout`` (``packed_params.forward_layout``),
so one forward reads them once however many models or tables use them.

Multimodal RoPE (megatron's ``MultimodalRotaryEmbedding``, ``per_token=True``) computes one angle
row per token from that token's own (3-D) position, for exactly the tokens the layer holds (under
context parallelism the caller hands it this rank's tokens' positions): the rows are used as they
are, never re-indexed by position within a packed segment or by CP rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loongforge.llm.layers.context_parallel_attention import GatheredLayout


def token_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed token's position inside its segment: ``arange(total) - cu_seqlens[segment]``."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    segment = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    return (tokens - cu_seqlens[segment]).long()


class RopeTables:
    """One model's one-entry cache: ``(cos, sin)`` of shape ``[*lead, rot_dim]`` (contiguous, fp32)
    for the angle tensor of its current forward, and what they were built for (the angles, lead
    shape, packing, ``mscale``, CP rank); a new angle tensor, lead shape or packing rebuilds it."""

    def __init__(self):
        self._key = None  # what _tables were built for; tensors compared by identity
        self._tables = None  # (cos, sin)

    def get(self, angles: torch.Tensor, lead: tuple[int, ...], cu_seqlens: torch.Tensor | None = None,
            mscale: float | None = None, cp: tuple[int, int] = (1, 0), per_token: bool = False,
            layout: GatheredLayout | None = None):
        """The tables for ``angles`` at the tokens of leading dims ``lead`` (packed: within the
        segments of ``cu_seqlens``; ``cp``: this CP rank's tokens). ``layout``: the forward's
        ``GatheredLayout`` of ``cu_seqlens``, which keeps a packed row's CP positions for the
        forward's other layers and models (None: computed here)."""
        key = (angles, tuple(lead), cu_seqlens, mscale, tuple(cp), per_token)
        if self._key is not None and all(a is b if torch.is_tensor(a) else a == b for a, b in zip(self._key, key)):
            return self._tables
        table = angles.reshape(angles.shape[0], angles.shape[-1]).float()  # [s, rot_dim]
        if per_token:
            if table.shape[0] != lead[0]:
                raise ValueError(f"per-token RoPE angles: {table.shape[0]} rows for {lead[0]} tokens")
        elif cp[0] > 1:
            if cu_seqlens is None and table.shape[0] != lead[0] * cp[0]:
                raise ValueError(f"RoPE under context parallelism needs the angles of the whole sequence "
                                 f"({lead[0] * cp[0]} rows), got {table.shape[0]}")
            positions = cp_positions(lead[0], cp, cu_seqlens, table.device, layout)
            if positions.numel() != lead[0]:
                raise ValueError(f"RoPE under context parallelism: {positions.numel()} positions for {lead[0]} tokens")
            table = table[positions]
        elif cu_seqlens is None:
            table = table[: lead[0]]
        else:
            table = table[token_positions(cu_seqlens, lead[0])]
        shape = (lead[0],) + (1,) * (len(lead) - 1) + (table.shape[-1],)
        cos, sin = (f(table).view(shape).expand(*lead, table.shape[-1]).contiguous() for f in (torch.cos, torch.sin))
        if mscale is not None and mscale != 1.0:
            cos, sin = cos * mscale, sin * mscale
        self._key, self._tables = key, (cos, sin)
        return cos, sin


def cp_positions(n_local: int, cp: tuple[int, int], cu_seqlens: torch.Tensor | None, device,
                 layout: GatheredLayout | None = None) -> torch.Tensor:
    """The RoPE positions (on ``device``) of CP rank ``cp[1]``'s ``n_local`` tokens of ``cp[0]``
    ranks (``local_positions``); a packed row's are computed once per ``layout`` (its forward's)."""
    from loongforge.llm.layers.context_parallel_attention import local_positions

    def compute():
        return local_positions(n_local, cp[0], cp[1], cu_seqlens, device=device).to(device)

    if cu_seqlens is None or layout is None or layout.cu_seqlens_padded is not cu_seqlens:
        return compute()
    return layout.cached(("rope positions", n_local, cp, device), compute)
