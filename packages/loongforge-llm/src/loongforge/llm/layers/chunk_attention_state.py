"""What ``FusedSelfAttention`` reads and writes while ChunkPipe runs one chunk of a sequence
(``loongforge.llm.chunk_pipe`` makes one per chunk and hands it to every attention layer)."""

from __future__ import annotations

import torch


class ChunkAttentionState:
    """What every attention layer reads and writes while one chunk runs."""

    def __init__(self, angles: torch.Tensor, prefix: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]):
        self.angles = angles  # [chunk, 1, 1, rot_dim]: the chunk's rows of the sequence's angles
        self.prefix = prefix  # layer -> the (keys, values) of each earlier chunk
        self.produced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keys_values(self, layer, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values over the earlier chunks and this one (``[s, b, groups, d]``)."""
        self.produced[id(layer)] = (key, value)
        earlier = self.prefix.get(id(layer), [])
        if not earlier:
            return key, value
        return (torch.cat([k for k, _ in earlier] + [key], dim=0),
                torch.cat([v for _, v in earlier] + [value], dim=0))
