"""Deterministic, resumable data order: global batch ``s`` is a pure function of (seed, s).

Samples are drawn from a stream of per-epoch permutations (epoch ``e`` uses a generator seeded
with ``seed + e``); global batch ``s`` is positions ``[s*B, (s+1)*B)`` of that stream, and
data-parallel rank ``r`` of ``W`` takes the ``r``-th contiguous ``B/W`` slice. Resuming at step
``s`` therefore replays exactly the batches an uninterrupted run would have seen, for any ``W``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class StepBatchSampler:
    def __init__(self, num_samples: int, global_batch: int, rank: int, world: int, seed: int, start_step: int = 0):
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        if global_batch % world:
            raise ValueError(f"train.global_batch_size={global_batch} is not divisible by the {world} data-parallel ranks")
        self.n, self.batch, self.rank, self.world, self.seed = num_samples, global_batch, rank, world, seed
        self.start_step = start_step
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        return self._perms[epoch]

    def global_batch(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.batch, (step + 1) * self.batch):
            out.append(int(self._perm(pos // self.n)[pos % self.n]))
        return out

    def local_batch(self, step: int) -> list[int]:
        per_rank = self.batch // self.world
        return self.global_batch(step)[self.rank * per_rank : (self.rank + 1) * per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield self.local_batch(step)
            step += 1
