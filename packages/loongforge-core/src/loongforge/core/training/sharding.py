"""The part of a tensor this rank holds: a whole tensor, or the dim-0 shard of an FSDP2 ``DTensor``
(FSDP2 splits rows like ``torch.chunk``: ``ceil(n / world)`` per rank). Checkpoints of the
PyTorch-native engine store these parts as pieces of the global tensor, and pretrained weights are
read into them row range by row range.
"""

from __future__ import annotations

import math

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """The locally held part of ``t`` (a view that can be written into)."""
    return t.to_local() if is_dtensor(t) else t


def region(like: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global offset and shape of the part of ``like`` this rank holds. HSDP tensors (sharded over
    the mesh's last dimension, replicated over the first) hold the rows of their shard group."""
    shape = tuple(like.shape)
    if not is_dtensor(like):
        return (0,) * len(shape), shape
    placements = like.placements
    shards = [(i, p) for i, p in enumerate(placements) if p.is_shard()]
    if len(shards) != 1 or shards[0][1].dim != 0 or any(not (p.is_shard() or p.is_replicate()) for p in placements):
        raise ValueError(f"only dim-0 sharded parameters are supported, got placements {placements}")
    mesh_dim = shards[0][0]
    mesh = like.device_mesh
    size, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    chunk = math.ceil(shape[0] / size)
    start = min(rank * chunk, shape[0])
    rows = local(like).shape[0]
    if rows != min(chunk, shape[0] - start):
        raise ValueError(f"unexpected FSDP shard: {rows} rows at offset {start} of {shape[0]} on rank {rank}/{size}")
    return (start,) + (0,) * (len(shape) - 1), (rows,) + shape[1:]


def writes_piece(like: torch.Tensor, is_main: bool) -> bool:
    """Whether this rank stores its part of ``like`` in a checkpoint: each shard once (the first
    replica group of an HSDP mesh), a whole (replicated) tensor on the main rank only."""
    if not is_dtensor(like):
        return is_main
    mesh = like.device_mesh
    for dim, placement in enumerate(like.placements):
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return False
    return region(like)[1][0] > 0 if like.dim() else True
