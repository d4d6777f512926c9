"""Move/swap refinement of a plan: shed load from the most loaded ranks onto the lighter ones.

Each round takes every rank above the tolerance (at most half the ranks), heaviest first. For
each of its samples i it looks for the best swap partner among the samples of all lighter ranks:
swapping i (cost c_i, on rank p) with j (on rank q) moves d = c_i - c_j and leaves
``max(load_p - d, load_q + d)``, best when c_j is near ``c_i - (load_p - load_q)/2``, so the
lighter ranks' samples, kept sorted by cost, are searched for that target (taken with the mean
load of the lighter ranks) and the ``NEIGHBOURS`` on each side of it are checked exactly. Moving i alone to one of the ``MOVE_TARGETS`` lightest ranks is
checked too. An action counts when it lowers the pair's larger load below load_p and keeps every
micro-batch within its token cap. Heaviest first, each heavy rank takes its best action whose
partner no heavier rank took; those are applied together (they share no rank), all vectorised
but the pick. When the most loaded rank has no such action the maximum cannot be lowered by one
move or swap and refinement ends.
"""

from __future__ import annotations

import numpy as np

from loongforge.core.balance.ordering import ordered
from loongforge.core.balance.packing import Bins

NEIGHBOURS = 2  # samples of the lighter ranks checked on each side of the ideal swap cost
MOVE_TARGETS = 2  # lightest ranks a single sample may move to
OPTIONS = 4  # ranked actions a heavy rank keeps in case a heavier rank took the partner


class Members:
    """Each rank's samples as rows of a padded matrix, with O(1) moves and swaps."""

    def __init__(self, rank_of: np.ndarray, num_ranks: int):
        self.count = np.bincount(rank_of, minlength=num_ranks)
        order = ordered(groups=rank_of)
        ranks = rank_of[order]
        within = np.arange(len(order)) - (np.cumsum(self.count) - self.count)[ranks]
        self.slots: np.ndarray = np.full((num_ranks, max(4, 2 * int(self.count.max()))), -1, dtype=np.int64)
        self.slots[ranks, within] = order
        self.pos = np.empty(len(rank_of), dtype=np.int64)
        self.pos[order] = within

    def move(self, i: np.ndarray, p: np.ndarray, q: np.ndarray) -> None:
        last_pos = self.count[p] - 1
        last = self.slots[p, last_pos]
        at = self.pos[i]
        self.slots[p, at] = last
        self.pos[last] = at
        self.slots[p, last_pos] = -1
        self.count[p] -= 1
        if int(self.count[q].max()) >= self.slots.shape[1]:
            self.slots = np.concatenate([self.slots, np.full_like(self.slots, -1)], axis=1)
        self.slots[q, self.count[q]] = i
        self.pos[i] = self.count[q]
        self.count[q] += 1

    def swap(self, i: np.ndarray, p: np.ndarray, j: np.ndarray, q: np.ndarray) -> None:
        pi, pj = self.pos[i], self.pos[j]
        self.slots[p, pi], self.slots[q, pj] = j, i
        self.pos[i], self.pos[j] = pj, pi


def _candidates(bins: Bins, members: Members, heavy: np.ndarray, light: np.ndarray, by_cost: np.ndarray):
    """Per heavy rank, its candidate actions: score (larger load after), partner rank, i, j (-1: a move).

    ``by_cost`` is every sample, by cost ascending (ties by position).
    """
    n_heavy = len(heavy)
    mp = int(members.count[heavy].max())
    p_items = members.slots[heavy, :mp]
    vp = p_items >= 0
    p_items = np.where(vp, p_items, 0)
    lp = bins.load[heavy][:, None, None]
    ci = np.where(vp, bins.costs[p_items], np.nan)[:, :, None]
    ti = bins.tokens[p_items][:, :, None]
    capped = np.isfinite(bins.cap)

    # swaps with the samples of the lighter ranks nearest the ideal cost
    is_light = np.zeros(bins.num_ranks, dtype=bool)
    is_light[light] = True
    pool = by_cost[is_light[bins.rank_of[by_cost]]]
    pool_cost = bins.costs[pool]
    target = ci[:, :, 0] - 0.5 * (lp[:, :, 0] - bins.load[light].mean())
    at = np.searchsorted(pool_cost, np.nan_to_num(target, nan=0.0))
    near = np.clip(at[:, :, None] + np.arange(-NEIGHBOURS, NEIGHBOURS)[None, None, :], 0, len(pool) - 1)
    j = pool[near]
    q = bins.rank_of[j]
    lq = bins.load[q]
    d = ci - pool_cost[near]
    ok = vp[:, :, None] & (d > 0) & (d < lp - lq)
    if capped:
        dt = ti - bins.tokens[j]
        ok &= bins.tok[heavy[:, None], bins.bin_of[p_items]][:, :, None] - dt <= bins.cap
        ok &= bins.tok[q, bins.bin_of[j]] + dt <= bins.cap
    swap_score = np.where(ok, np.maximum(lp - d, lq + d), np.inf)

    # moves of one sample to one of the lightest ranks
    dest = light[:MOVE_TARGETS]
    ld = bins.load[dest][None, None, :]
    ok = vp[:, :, None] & (ci < lp - ld)
    if capped and not bins.growable:
        ok &= ti <= (bins.cap - bins.tok[dest].min(axis=1))[None, None, :]
    move_score = np.where(ok, np.maximum(lp - ci, ld + ci), np.inf)

    shape = (n_heavy, -1)
    score = np.concatenate([swap_score.reshape(shape), move_score.reshape(shape)], axis=1)
    partner = np.concatenate([q.reshape(shape), np.broadcast_to(dest, move_score.shape).reshape(shape)], axis=1)
    first = np.concatenate([np.broadcast_to(p_items[:, :, None], swap_score.shape).reshape(shape),
                            np.broadcast_to(p_items[:, :, None], move_score.shape).reshape(shape)], axis=1)
    second = np.concatenate([j.reshape(shape), np.full((n_heavy, move_score[0].size), -1)], axis=1)
    score = np.where(score < bins.load[heavy][:, None] * (1.0 - 1e-12), score, np.inf)
    return score, partner, first, second


def _best_columns(score: np.ndarray, k: int) -> np.ndarray:
    """The columns of each row's k lowest scores, lowest first (ties: lower column)."""
    score = score.copy()
    rows = np.arange(score.shape[0])
    best = []
    for _ in range(min(k, score.shape[1])):
        col = np.argmin(score, axis=1)
        best.append(col)
        score[rows, col] = np.inf
    return np.stack(best, axis=1)


def refine(bins: Bins, *, tolerance: float, max_rounds: int) -> int:
    """Refine ``bins`` in place; returns the number of rounds run."""
    num_ranks = bins.num_ranks
    if num_ranks < 2:
        return 0
    limit = bins.load.mean() * (1.0 + tolerance)
    members: Members | None = None
    by_cost = np.arange(0)
    for rounds in range(max_rounds):
        over = int(np.count_nonzero(bins.load > limit))
        if over == 0:
            return rounds
        if members is None:
            members = Members(bins.rank_of, num_ranks)
            by_cost = ordered(bins.costs, descending=False)
        order = np.argsort(bins.load, kind="stable")
        n_heavy = max(1, min(over, num_ranks // 2))
        heavy, light = order[::-1][:n_heavy], order[:num_ranks - n_heavy]
        score, partner, first, second = _candidates(bins, members, heavy, light, by_cost)
        ranked = _best_columns(score, OPTIONS)
        good = np.isfinite(np.take_along_axis(score, ranked, axis=1))
        if not good[0].any():
            return rounds + 1  # the most loaded rank cannot shed load: the maximum is final
        partner_of = np.take_along_axis(partner, ranked, axis=1).tolist()
        taken, chosen = set(), []
        for h, (options, fine) in enumerate(zip(partner_of, good.tolist())):
            for option, (q, ok) in enumerate(zip(options, fine)):
                if not ok:
                    break
                if q not in taken:
                    taken.add(q)
                    chosen.append((h, int(ranked[h, option])))
                    break
        rows = np.array([h for h, _ in chosen], dtype=np.int64)
        cols = np.array([c for _, c in chosen], dtype=np.int64)
        p, q = heavy[rows], partner[rows, cols]
        i, j = first[rows, cols], second[rows, cols]
        swap = j >= 0
        if swap.any():
            bins.swap(i[swap], j[swap])
            members.swap(i[swap], p[swap], j[swap], q[swap])
        move = ~swap
        if move.any():
            bins.remove(i[move])
            bins.add(q[move], i[move])
            members.move(i[move], p[move], q[move])
    return max_rounds
