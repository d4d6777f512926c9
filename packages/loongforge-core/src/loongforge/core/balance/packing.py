"""Micro-batches of every rank: token-capped bins, their loads, and moves between them.

A rank's micro-batches are bins of at most ``cap`` tokens (``inf`` without a token cap). With a
fixed ``max_micro_batches`` each rank has that many bins; with a cap and no maximum
("growable") a rank opens bins as it needs them; with neither, a rank has one bin.
"""

from __future__ import annotations

import numpy as np

from loongforge.core.balance.ordering import ordered
from loongforge.core.errors import UserError


class PlanError(UserError, ValueError):
    """The step's samples cannot be placed under the given caps."""


class Bins:
    """Which rank and micro-batch each sample is in, and the token and cost load of every bin."""

    def __init__(self, costs: np.ndarray, tokens: np.ndarray, num_ranks: int, token_cap: int | None,
                 max_micro_batches: int | None):
        self.costs, self.tokens, self.num_ranks = costs, tokens, num_ranks
        self.cap = np.inf if token_cap is None else float(token_cap)
        self.growable = token_cap is not None and max_micro_batches is None
        self.max_micro_batches = max_micro_batches
        self.rank_of = np.full(len(costs), -1, dtype=np.int64)
        self.bin_of = np.full(len(costs), -1, dtype=np.int64)
        self.load = np.zeros(num_ranks)
        self.tok: np.ndarray = np.zeros((num_ranks, 1))
        self.bcost: np.ndarray = np.zeros((num_ranks, 1))
        self.used = np.zeros(num_ranks, dtype=np.int64)  # bins a rank may use (growable: opened so far)

    @property
    def width(self) -> int:
        return self.tok.shape[1]

    def _reserve(self, width: int) -> None:
        if width > self.width:
            pad = np.zeros((self.num_ranks, width - self.width))
            self.tok = np.concatenate([self.tok, pad], axis=1)
            self.bcost = np.concatenate([self.bcost, pad], axis=1)

    def _reset(self, width: int) -> None:
        self.tok = np.zeros((self.num_ranks, width))
        self.bcost = np.zeros((self.num_ranks, width))
        self.load = np.zeros(self.num_ranks)

    def _recount(self) -> None:
        placed = self.rank_of >= 0
        key = (self.rank_of * self.width + self.bin_of)[placed]
        size = self.num_ranks * self.width
        self.tok = np.bincount(key, weights=self.tokens[placed], minlength=size).reshape(self.num_ranks, self.width)
        self.bcost = np.bincount(key, weights=self.costs[placed], minlength=size).reshape(self.num_ranks, self.width)
        self.load = self.bcost.sum(axis=1)

    # -- initial packing ---------------------------------------------------------------------
    def pack(self, rank_of: np.ndarray) -> np.ndarray:
        """Put each sample in a micro-batch of its given rank; returns the samples that fit nowhere there.

        - No token cap: a rank's samples, largest cost first, are dealt to its
          ``min(max_micro_batches, samples)`` bins (or one) in snake order (0..k-1, k-1..0, ...),
          which evens the bins' costs to within one sample.
        - Token cap, no maximum: a rank's samples, largest first, are laid end to end and cut
          every ``cap`` tokens; a sample the cut would split goes to a later pass over the
          samples so left (a sample alone never is split), whose bins come after.
        - Token cap and a maximum: in rounds, the k-th largest sample of every rank goes to its
          cheapest bin with room; the samples that find none are returned unplaced.
        """
        self._reset(self.max_micro_batches or 1)
        if not np.isfinite(self.cap):
            self._deal_snake(rank_of)
        elif self.growable:
            self._cut_end_to_end(rank_of)
        else:
            return self._rounds(rank_of)
        self._recount()
        self.used = np.full(self.num_ranks, self.width, dtype=np.int64)
        return np.zeros(0, dtype=np.int64)

    def _deal_snake(self, rank_of: np.ndarray) -> None:
        order = ordered(self.costs, groups=rank_of)
        ranks = rank_of[order]
        count = np.bincount(rank_of, minlength=self.num_ranks)
        within = np.arange(len(order)) - (np.cumsum(count) - count)[ranks]
        k = np.clip(count, 1, self.max_micro_batches or 1)[ranks]
        turn, pos = np.divmod(within, k)
        self.rank_of[order] = ranks
        self.bin_of[order] = np.where(turn % 2 == 0, pos, k - 1 - pos)

    def _cut_end_to_end(self, rank_of: np.ndarray) -> None:
        order = ordered(self.tokens, groups=rank_of)
        ranks, toks = rank_of[order], self.tokens[order]
        first_bin = np.zeros(self.num_ranks, dtype=np.int64)
        bin_sorted = np.empty(len(order), dtype=np.int64)
        rest = np.arange(len(order))
        while rest.size:
            r, t = ranks[rest], toks[rest]
            ends = np.cumsum(t)
            new_group = np.ones(len(rest), dtype=bool)
            new_group[1:] = r[1:] != r[:-1]
            group = np.cumsum(new_group) - 1
            starts = ends - t - (ends - t)[new_group][group]
            b = np.floor(starts / self.cap).astype(np.int64)
            split = starts + t > (b + 1) * self.cap
            keep = ~split
            bin_sorted[rest[keep]] = first_bin[r[keep]] + b[keep]
            last = np.append(np.flatnonzero(new_group[1:]), len(rest) - 1)
            first_bin[r[last]] += b[last] + 1
            rest = rest[split]
        width = int(first_bin.max())
        self.rank_of[order], self.bin_of[order] = ranks, bin_sorted
        self._reset(width)

    def _rounds(self, rank_of: np.ndarray) -> np.ndarray:
        self.used = np.full(self.num_ranks, self.width, dtype=np.int64)
        order = ordered(self.tokens, groups=rank_of)
        ranks = rank_of[order]
        count = np.bincount(rank_of, minlength=self.num_ranks)
        within = np.arange(len(order)) - (np.cumsum(count) - count)[ranks]
        by_round = order[ordered(within.astype(np.float64), descending=False)]
        bounds = np.cumsum(np.bincount(within))[:-1]
        left = []
        for chosen in np.split(by_round, bounds):
            ok = self.fits(rank_of[chosen], self.tokens[chosen]).any(axis=1)
            if ok.any():
                self.add(rank_of[chosen[ok]], chosen[ok])
            left.append(chosen[~ok])
        return np.concatenate(left) if left else np.zeros(0, dtype=np.int64)

    # -- single placements -------------------------------------------------------------------
    def fits(self, ranks: np.ndarray, add_tokens: np.ndarray) -> np.ndarray:
        """(k, width) mask: bin b of ``ranks[k]`` has room for ``add_tokens[k]`` more tokens."""
        fits = self.tok[ranks] + add_tokens[:, None] <= self.cap
        return fits & (np.arange(self.width)[None, :] < self.used[ranks][:, None])

    def add(self, ranks: np.ndarray, samples: np.ndarray) -> None:
        """Put ``samples[k]`` on ``ranks[k]`` (distinct ranks, each with room or growable), cheapest bin first."""
        t, c = self.tokens[samples], self.costs[samples]
        fits = self.fits(ranks, t)
        b = np.argmin(np.where(fits, self.bcost[ranks], np.inf), axis=1)
        fresh = ~fits[np.arange(len(ranks)), b]
        if fresh.any():
            if not self.growable:
                raise PlanError(f"samples {samples[fresh].tolist()} have no room on ranks {ranks[fresh].tolist()}")
            b[fresh] = self.used[ranks[fresh]]
            self.used[ranks[fresh]] += 1
            self._reserve(int(self.used.max()))
        self.tok[ranks, b] += t
        self.bcost[ranks, b] += c
        self.load[ranks] += c
        self.rank_of[samples], self.bin_of[samples] = ranks, b

    def remove(self, samples: np.ndarray) -> None:
        """Take ``samples`` (on distinct ranks) out of their bins."""
        r, b = self.rank_of[samples], self.bin_of[samples]
        self.tok[r, b] -= self.tokens[samples]
        self.bcost[r, b] -= self.costs[samples]
        self.load[r] -= self.costs[samples]
        self.rank_of[samples] = self.bin_of[samples] = -1

    def add_anywhere(self, s: int) -> None:
        """Put sample ``s`` on the least-loaded rank that has room for it."""
        fits = self.fits(np.arange(self.num_ranks), np.full(self.num_ranks, self.tokens[s]))
        open_ranks = np.flatnonzero(fits.any(axis=1))
        if open_ranks.size == 0:
            fill = self.tokens.sum() / (self.num_ranks * self.width * self.cap)
            raise PlanError(
                f"the planner found no micro-batch with room for sample {s} of the step ({int(self.tokens[s])} "
                f"tokens): the step fills {fill:.0%} of {self.num_ranks} ranks x {self.width} micro-batches of "
                f"{int(self.cap)} tokens; raise max_micro_batches or token_cap, or lower the samples per step"
            )
        self.add(np.array([open_ranks[np.argmin(self.load[open_ranks])]]), np.array([s]))

    def swap(self, i: np.ndarray, j: np.ndarray) -> None:
        """Exchange samples ``i[k]`` and ``j[k]`` (all ranks distinct), each taking the other's bin."""
        p, bp, q, bq = self.rank_of[i], self.bin_of[i], self.rank_of[j], self.bin_of[j]
        dt = self.tokens[i] - self.tokens[j]
        dc = self.costs[i] - self.costs[j]
        self.tok[p, bp] -= dt
        self.tok[q, bq] += dt
        self.bcost[p, bp] -= dc
        self.bcost[q, bq] += dc
        self.load[p] -= dc
        self.load[q] += dc
        self.rank_of[i], self.bin_of[i] = q, bq
        self.rank_of[j], self.bin_of[j] = p, bp

    # -- result ------------------------------------------------------------------------------
    def dense_micro(self) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's micro-batch renumbered 0..k-1 over the rank's non-empty bins, and k per rank."""
        key = self.rank_of * self.width + self.bin_of
        full = (np.bincount(key, minlength=self.num_ranks * self.width) > 0).reshape(self.num_ranks, self.width)
        renumber = np.cumsum(full, axis=1) - 1
        return renumber[self.rank_of, self.bin_of].astype(np.int64), full.sum(axis=1)
