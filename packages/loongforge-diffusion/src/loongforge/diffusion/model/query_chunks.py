"""A segment's queries as a batch of chunks against copies of its keys.

With many more queries than keys (video tokens against a prompt), one attention call over the
whole segment leaves a flash backward few key blocks to parallelise over; the same queries as a
batch of chunks, each against the same keys, give it that many times the programs. ``attention``
(its SDPA path) and ``segment_attention`` (the cuDNN op) split the queries the same way.
"""

from __future__ import annotations

import torch

MAX_QUERY_CHUNKS = 8


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` -> ``[1, H, T, D]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def query_chunks(tq: int, tk: int) -> int:
    """How many chunks ``tq`` queries split into against ``tk`` keys: 1 unless there are at least
    4x more queries than keys (cross-attention of video tokens to a prompt)."""
    return min(MAX_QUERY_CHUNKS, tq // (2 * tk)) if 0 < 4 * tk <= tq else 1


def as_query_chunks(q: torch.Tensor, chunks: int) -> torch.Tensor:
    """``[L, H, D]`` -> ``[chunks, H, L', D]``, rows zero-padded to a multiple of ``chunks`` (a view
    of the packed layout when none are needed; ``chunks=1`` is diffusers' ``[1, H, L, D]``)."""
    pad = -q.shape[0] % chunks
    if pad:
        q = torch.cat([q, q.new_zeros(pad, *q.shape[1:])])
    return q.unflatten(0, (chunks, -1)).transpose(1, 2)


def from_query_chunks(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`as_query_chunks`: ``[chunks, H, L', ...]`` -> ``[rows, H, ...]``."""
    return t.transpose(1, 2).flatten(0, 1)[:rows]


def key_copies(k: torch.Tensor, chunks: int) -> torch.Tensor:
    """``[Lk, H, D]`` -> ``[chunks, H, Lk, D]``: the keys once per query chunk (copies: a few MB;
    broadcast stride-0 keys measured no faster)."""
    k = heads_first(k)
    return k.expand(chunks, -1, -1, -1).contiguous() if chunks > 1 else k
