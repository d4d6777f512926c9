"""Textbook multiway number partitioning, the baselines ``plan_step`` is measured against: each
assigns one step's samples to ranks by cost alone (no token cap, no micro-batches).

- ``lpt_assignment``: largest-first greedy (LPT): samples by decreasing cost, each to the rank
  with the smallest load so far.
- ``karmarkar_karp_assignment``: the multiway Karmarkar-Karp differencing heuristic: every sample
  starts as a partial partition (its cost on one rank, nothing on the others); the two partial
  partitions with the largest spread (max - min load) are merged, the heaviest part of one with
  the lightest of the other, until one is left. O(n * ranks) work and memory.
"""

from __future__ import annotations

import heapq

import numpy as np


def lpt_assignment(costs: np.ndarray, num_ranks: int) -> np.ndarray:
    """The rank of each sample under largest-first greedy; ties go to the lowest rank."""
    costs = np.asarray(costs, dtype=np.float64)
    rank_of = np.empty(len(costs), dtype=np.int64)
    loads = [(0.0, r) for r in range(num_ranks)]
    for i in np.argsort(-costs, kind="stable"):
        load, r = heapq.heappop(loads)
        rank_of[i] = r
        heapq.heappush(loads, (load + costs[i], r))
    return rank_of


def karmarkar_karp_assignment(costs: np.ndarray, num_ranks: int) -> np.ndarray:
    """The rank of each sample under multiway Karmarkar-Karp differencing."""
    costs = np.asarray(costs, dtype=np.float64)
    k = num_ranks
    heap = []  # (-spread, tie-break, loads in decreasing order, the samples of each part)
    for i, c in enumerate(costs):
        parts = [[i]] + [[] for _ in range(k - 1)]
        loads = np.zeros(k)
        loads[0] = c
        heap.append((-float(c), i, loads, parts))
    heapq.heapify(heap)
    counter = len(costs)
    while len(heap) > 1:
        _, _, loads_a, parts_a = heapq.heappop(heap)
        _, _, loads_b, parts_b = heapq.heappop(heap)
        loads = loads_a + loads_b[::-1]  # the heaviest of one with the lightest of the other
        parts = [a + b for a, b in zip(parts_a, reversed(parts_b))]
        order = np.argsort(-loads, kind="stable")
        loads = loads[order] - loads[order[-1]]
        parts = [parts[j] for j in order]
        heapq.heappush(heap, (-float(loads[0]), counter, loads, parts))
        counter += 1
    rank_of = np.empty(len(costs), dtype=np.int64)
    for r, part in enumerate(heap[0][3]):
        rank_of[part] = r
    return rank_of
