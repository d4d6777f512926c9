"""Rank assignments of one step's samples by cost alone: plain (contiguous) and largest-first greedy."""

from __future__ import annotations

import heapq

import numpy as np

from loongforge.core.balance.ordering import ordered

BIG_FRACTION = 1 / 8  # samples costing more than this share of the mean rank cost are placed one by one
MEDIUM_FRACTION = 1 / 32  # ... more than this share, a block of ranks at a time
FINEST_BAND = 1e-5  # below this share of the mean rank cost, the remaining samples are filled in one band


def plain_assignment(num_samples: int, num_ranks: int) -> np.ndarray:
    """Contiguous chunks: the first ``n % R`` ranks take one sample more (``numpy.array_split``)."""
    base, extra = divmod(num_samples, num_ranks)
    sizes = np.full(num_ranks, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.repeat(np.arange(num_ranks, dtype=np.int64), sizes)


def water_level(loads: np.ndarray, amount: float) -> float:
    """The level W with ``sum(max(0, W - loads)) == amount``."""
    sorted_loads = np.sort(loads)
    levels = (amount + np.cumsum(sorted_loads)) / np.arange(1, len(loads) + 1)
    return float(levels[np.flatnonzero(sorted_loads <= levels)[-1]])


def greedy_assignment(costs: np.ndarray, num_ranks: int) -> np.ndarray:
    """Largest-first assignment of samples to ranks, minimising the most loaded rank.

    Samples are taken in decreasing cost, in three tiers by their share of the mean rank cost T:

    1. above ``BIG_FRACTION * T`` (at most ``num_ranks / BIG_FRACTION`` samples, and at least the
       first ``num_ranks``, so no rank is left empty): one by one to the least-loaded rank (LPT);
    2. above ``MEDIUM_FRACTION * T``: in blocks of ``num_ranks // 4``, the block's k-th largest
       to the k-th least-loaded rank (LPT, vectorised a block at a time);
    3. the rest, in bands of halving cost: each band fills the ranks towards a common water
       level (with the ranks' room to the level laid end to end, a sample goes to the rank that
       holds the middle of its cost interval), so each rank lands within half a band-sample of
       the level, and the next, finer band evens that out.

    Ties go to the lower position and the lower rank.
    """
    n = len(costs)
    order = ordered(costs)
    sorted_costs = costs[order]
    mean_rank = float(sorted_costs.sum()) / num_ranks
    rank_of = np.empty(n, dtype=np.int64)

    def count_above(fraction: float) -> int:
        return int(np.searchsorted(-sorted_costs, -fraction * mean_rank, side="left"))

    n_big = max(count_above(BIG_FRACTION), min(n, num_ranks))
    heap = [(0.0, r) for r in range(num_ranks)]
    big_ranks = []
    for cost in sorted_costs[:n_big].tolist():
        load, r = heap[0]
        heapq.heapreplace(heap, (load + cost, r))
        big_ranks.append(r)
    rank_of[order[:n_big]] = big_ranks
    loads = np.zeros(num_ranks)
    for load, r in heap:
        loads[r] = load

    n_medium = max(count_above(MEDIUM_FRACTION), n_big)
    block = max(1, num_ranks // 4)
    for start in range(n_big, n_medium, block):
        items = sorted_costs[start:min(start + block, n_medium)]
        ranks = np.argsort(loads, kind="stable")[:len(items)]
        rank_of[order[start:start + len(items)]] = ranks
        loads[ranks] += items

    start, ceiling = n_medium, MEDIUM_FRACTION * mean_rank
    while start < n:
        ceiling *= 0.5
        if ceiling < FINEST_BAND * mean_rank:
            stop = n
        else:
            stop = max(int(np.searchsorted(-sorted_costs, -ceiling, side="left")), start)
        if stop == start:
            continue
        band = sorted_costs[start:stop]
        level = water_level(loads, float(band.sum()))
        room = np.cumsum(np.maximum(level - loads, 0.0))
        middle = np.cumsum(band) - 0.5 * band
        target = np.minimum(np.searchsorted(room, middle, side="right"), num_ranks - 1)
        rank_of[order[start:stop]] = target
        loads += np.bincount(target, weights=band, minlength=num_ranks)
        start = stop
    return rank_of
