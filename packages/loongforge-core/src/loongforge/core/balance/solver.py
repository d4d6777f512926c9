"""Assign one step's samples to DP ranks and micro-batches so the slowest rank is as fast as possible.

``plan_step(costs, tokens, num_ranks, ...)`` is a pure function: every rank calls it on the same
global list of sample costs and gets the same ``Plan`` bit for bit (deterministic numpy
operations, stable sorts, ties to the lower position and rank; no clocks, no randomness), so
no data and no plan travels over the network.

Micro-batches hold at most ``token_cap`` tokens each (the packing length); a rank has at most
``max_micro_batches`` of them (``None``: as many as its samples need). Without a token cap a
rank's samples share ``max_micro_batches`` micro-batches (one when that is ``None``). Empty
micro-batches are never returned, so a rank may get fewer than ``max_micro_batches``.

The steps:

1. The plain plan: contiguous equal-count chunks of the step, one per rank (what a plain
   distributed sampler does). When its imbalance (max/mean rank cost) is at most
   ``skip_threshold`` and it fits the caps, it is returned as is.
2. Largest-first greedy (``assign.greedy_assignment``), then packing into micro-batches
   (``packing.Bins.pack``); a sample that does not fit on its rank goes to the least-loaded rank
   with room, and one that fits nowhere is a ``PlanError``.
3. Move/swap refinement (``refine.refine``) until max/mean <= 1 + ``tolerance``.
4. The better of that and the plain plan (when the plain plan fits) is returned, so the
   imbalance never gets worse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from loongforge.core.balance.assign import greedy_assignment, plain_assignment
from loongforge.core.balance.metrics import BalanceMetrics, imbalance
from loongforge.core.balance.packing import Bins, PlanError
from loongforge.core.balance.refine import refine

__all__ = ["Plan", "PlanError", "plan_step"]


@dataclass(frozen=True, eq=False)
class Plan:
    """Where each of the step's samples (positions ``0..n-1``) goes.

    ``rank[i]`` is the DP rank of sample i and ``micro[i]`` its micro-batch on that rank
    (``0..micro_counts[rank]-1``); ``rank_costs`` is each rank's summed cost.
    """

    num_ranks: int
    rank: np.ndarray
    micro: np.ndarray
    micro_counts: np.ndarray
    rank_costs: np.ndarray
    metrics: BalanceMetrics

    def micro_batches(self, rank: int) -> list[list[int]]:
        """The sample positions of each micro-batch of ``rank``, ascending within a micro-batch."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank={rank} is outside 0..{self.num_ranks - 1}")
        mine = np.flatnonzero(self.rank == rank)
        micro = self.micro[mine]
        order = np.argsort(micro, kind="stable")
        bounds = np.cumsum(np.bincount(micro, minlength=int(self.micro_counts[rank])))[:-1]
        return [part.tolist() for part in np.split(mine[order], bounds)]

    def same_assignment(self, other: Plan) -> bool:
        return (self.num_ranks == other.num_ranks and np.array_equal(self.rank, other.rank)
                and np.array_equal(self.micro, other.micro))


def _validate(costs, tokens, num_ranks, token_cap, max_micro_batches) -> None:
    n = costs.shape[0]
    if costs.ndim != 1 or tokens.shape != costs.shape:
        raise ValueError(f"costs and tokens must be 1-d of one length, got shapes {costs.shape} and {tokens.shape}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    if n < num_ranks:
        raise PlanError(f"{n} samples cannot give each of {num_ranks} ranks at least one")
    if not np.all(np.isfinite(costs)) or np.any(costs <= 0):
        raise ValueError("costs must be finite and > 0")
    if max_micro_batches is not None and max_micro_batches < 1:
        raise ValueError(f"max_micro_batches={max_micro_batches} must be >= 1")
    if token_cap is None:
        return
    if token_cap < 1:
        raise ValueError(f"token_cap={token_cap} must be >= 1")
    too_long = np.flatnonzero(tokens > token_cap)
    if too_long.size:
        s = int(too_long[0])
        raise PlanError(
            f"sample {s} of the step has {int(tokens[s])} tokens, more than token_cap={token_cap} "
            f"(the packing length); {too_long.size} sample(s) exceed it: truncate or split them, or raise the cap"
        )
    if max_micro_batches is not None and tokens.sum() > num_ranks * max_micro_batches * token_cap:
        raise PlanError(
            f"the step has {int(tokens.sum())} tokens, more than num_ranks*max_micro_batches*token_cap = "
            f"{num_ranks}*{max_micro_batches}*{token_cap}"
        )


def _finish(bins: Bins, before: np.ndarray, rebalanced: bool, t0: float) -> Plan:
    micro, counts = bins.dense_micro()
    after = np.bincount(bins.rank_of, weights=bins.costs, minlength=bins.num_ranks)
    metrics = BalanceMetrics(
        imbalance_before=imbalance(before), imbalance_after=imbalance(after),
        max_cost_before=float(before.max()), max_cost_after=float(after.max()),
        mean_cost=float(before.mean()), rebalanced=rebalanced,
        solver_ms=(time.perf_counter() - t0) * 1e3,
    )
    return Plan(bins.num_ranks, bins.rank_of.copy(), micro, counts, after, metrics)


def plan_step(
    costs: np.ndarray,
    tokens: np.ndarray,
    num_ranks: int,
    *,
    token_cap: int | None = None,
    max_micro_batches: int | None = None,
    skip_threshold: float = 1.02,
    tolerance: float = 2e-3,
    max_refine_rounds: int = 256,
) -> Plan:
    """Plan one step; ``costs[i]`` and ``tokens[i]`` describe the step's i-th sample.

    ``tolerance``: refinement stops once max/mean <= 1 + tolerance. ``max_refine_rounds``
    bounds the refinement rounds, and so the time per step.
    """
    t0 = time.perf_counter()
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    tokens = np.ascontiguousarray(tokens, dtype=np.float64)
    _validate(costs, tokens, num_ranks, token_cap, max_micro_batches)

    def packed(rank_of: np.ndarray) -> tuple[Bins, np.ndarray]:
        bins = Bins(costs, tokens, num_ranks, token_cap, max_micro_batches)
        return bins, bins.pack(rank_of)

    plain_rank = plain_assignment(len(costs), num_ranks)
    before = np.bincount(plain_rank, weights=costs, minlength=num_ranks)
    if imbalance(before) <= skip_threshold:
        plain, left = packed(plain_rank)
        if left.size == 0:
            return _finish(plain, before, False, t0)

    bins, left = packed(greedy_assignment(costs, num_ranks))
    for s in left.tolist():
        bins.add_anywhere(s)
    refine(bins, tolerance=tolerance, max_rounds=max_refine_rounds)
    if bins.load.max() >= before.max():
        plain, left = packed(plain_rank)
        if left.size == 0:
            return _finish(plain, before, False, t0)
    return _finish(bins, before, True, t0)
