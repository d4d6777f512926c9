"""Which samples a step trains on, and on which rank and micro-batch.

The order is a fixed function of (seed, step): epoch ``e`` is a seeded permutation of the dataset
and step ``s`` takes positions ``[s*B, (s+1)*B)`` of the concatenated epochs. Every rank computes
the same global list and the same plan from ``loongforge.core.balance.plan_step`` over the
samples' costs, so nothing is communicated and a resumed run continues exactly.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from loongforge.core.balance import CostModel, Plan, SampleSizes, plan_step


def stream_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(stream_seed(*parts))


def step_samples(step: int, batch_size: int, dataset_size: int, seed: int) -> list[int]:
    """Dataset indices of the ``batch_size`` samples of ``step``."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), dataset_size)
        perm = np.random.default_rng(stream_seed(seed, epoch)).permutation(dataset_size)
        take = min(batch_size - len(out), dataset_size - offset)
        out.extend(int(i) for i in perm[offset : offset + take])
    return out


def plan(tokens: list[int], cost_model: CostModel, num_ranks: int, token_cap: int | None, skip_threshold: float) -> Plan:
    """Rank and micro-batch of each of the step's samples (token counts ``tokens``); the plain
    contiguous split is kept when its max/mean rank cost is at most ``skip_threshold``."""
    tok = np.asarray(tokens, dtype=np.int64)
    costs = cost_model.costs(SampleSizes.from_lengths(tok))
    return plan_step(costs, tok, num_ranks, token_cap=token_cap, skip_threshold=skip_threshold)
