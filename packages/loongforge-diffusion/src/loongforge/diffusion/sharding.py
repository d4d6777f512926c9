"""The part of a parameter this rank holds: a whole tensor, or the dim-0 shard of an FSDP2
``DTensor`` (FSDP2 splits rows like ``torch.chunk``: ``ceil(n / world)`` per rank)."""

from __future__ import annotations

import math

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """The locally held part of ``t`` (a view that can be written into)."""
    return t.to_local() if is_dtensor(t) else t


def region(like: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global offset and shape of the part of ``like`` this rank holds."""
    shape = tuple(like.shape)
    if not is_dtensor(like):
        return (0,) * len(shape), shape
    placements = like.placements
    if len(placements) != 1 or not (placements[0].is_shard() and placements[0].dim == 0):
        raise ValueError(f"only dim-0 sharded parameters are supported, got placements {placements}")
    mesh = like.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    chunk = math.ceil(shape[0] / size)
    start = min(rank * chunk, shape[0])
    rows = local(like).shape[0]
    if rows != min(chunk, shape[0] - start):
        raise ValueError(f"unexpected FSDP shard: {rows} rows at offset {start} of {shape[0]} on rank {rank}/{size}")
    return (start,) + (0,) * (len(shape) - 1), (rows,) + shape[1:]
