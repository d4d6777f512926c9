"""Move/swap refinement of a plan: shed load from the most loaded ranks onto the least loaded.

Each round takes the H most loaded ranks above the tolerance and the L least loaded ranks (H
and L sized so that H*L pairs of candidate swaps fit a fixed budget) and, for every
(heavy, light) pair at once (vectorised), finds the single move of one sample, or swap of two,
that lowers the pair's larger load the most while keeping every micro-batch under its token cap.
Heaviest first, each heavy rank takes its best light partner that no heavier rank took; those
actions are applied together (they share no rank). When no pair improves, the maximum cannot be
lowered by one move or swap against the light ranks and refinement ends.
"""

from __future__ import annotations

import numpy as np

from loongforge.core.balance.ordering import ordered

from loongforge.core.balance.packing import Bins

BUDGET = 1 << 15  # candidate swaps scored per round (bounds the time of a round)


class Members:
    """Each rank's samples as rows of a padded matrix, with O(1) moves and swaps."""

    def __init__(self, rank_of: np.ndarray, num_ranks: int):
        self.count = np.bincount(rank_of, minlength=num_ranks)
        order = ordered(groups=rank_of)
        ranks = rank_of[order]
        within = np.arange(len(order)) - (np.cumsum(self.count) - self.count)[ranks]
        self.slots = np.full((num_ranks, max(4, 2 * int(self.count.max()))), -1, dtype=np.int64)
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


def _best_actions(bins: Bins, members: Members, heavy: np.ndarray, light: np.ndarray):
    """For each pair (heavy[k], light[k]): the best move or swap and the larger load after it.

    Moving or swapping cost d from p to q leaves ``max(load_p - d, load_q + d)``, which is
    ``mid + |d - gap/2|`` (mid the pair's mean load, gap their difference) and lower than load_p
    exactly when ``|d - gap/2| < gap/2``. Padding slots carry NaN and so are never valid.
    """
    k = len(heavy)
    rows = np.arange(k)
    mp, mq = int(members.count[heavy].max()), int(members.count[light].max())
    p_items, q_items = members.slots[heavy, :mp], members.slots[light, :mq]
    vp, vq = p_items >= 0, q_items >= 0
    p_items, q_items = np.where(vp, p_items, 0), np.where(vq, q_items, 0)
    ci = np.where(vp, bins.costs[p_items], np.nan)
    cj = np.where(vq, bins.costs[q_items], np.nan)
    lp, lq = bins.load[heavy], bins.load[light]
    half = (0.5 * (lp - lq))[:, None]
    mid = 0.5 * (lp + lq)
    capped = np.isfinite(bins.cap)

    err = np.abs(ci - half)
    valid = err < half
    if capped and not bins.growable:
        room = bins.cap - bins.tok[light].min(axis=1)
        valid &= bins.tokens[p_items] <= room[:, None]
    move_err = np.where(valid, err, np.inf)
    move_at = np.argmin(move_err, axis=1)
    move_best = move_err[rows, move_at]

    err = np.abs(ci[:, :, None] - cj[:, None, :] - half[:, :, None])
    valid = err < half[:, :, None]
    if capped:
        ti = np.where(vp, bins.tokens[p_items], np.nan)
        tj = np.where(vq, bins.tokens[q_items], np.nan)
        lo = bins.tok[heavy[:, None], bins.bin_of[p_items]] - bins.cap  # dt must be >= this ...
        hi = bins.cap - bins.tok[light[:, None], bins.bin_of[q_items]]  # ... and <= this
        dt = ti[:, :, None] - tj[:, None, :]
        valid &= (dt >= lo[:, :, None]) & (dt <= hi[:, None, :])
    swap_err = np.where(valid, err, np.inf).reshape(k, -1)
    swap_at = np.argmin(swap_err, axis=1)
    swap_best = swap_err[rows, swap_at]

    is_swap = swap_best < move_best
    best = np.where(is_swap, swap_best, move_best)
    score = mid + best
    i = np.where(is_swap, p_items[rows, swap_at // mq], p_items[rows, move_at])
    j = q_items[rows, swap_at % mq]
    improves = np.isfinite(best) & (score < lp * (1.0 - 1e-12))
    return score, improves, is_swap, i, j


def _apply(bins: Bins, members: Members, heavy, light, is_swap, i, j) -> None:
    s = is_swap
    if s.any():
        bins.swap(i[s], j[s])
        members.swap(i[s], heavy[s], j[s], light[s])
    m = ~is_swap
    if m.any():
        bins.remove(i[m])
        bins.add(light[m], i[m])
        members.move(i[m], heavy[m], light[m])


def refine(bins: Bins, *, tolerance: float, max_rounds: int) -> int:
    """Refine ``bins`` in place; returns the number of rounds run."""
    num_ranks = bins.num_ranks
    if num_ranks < 2:
        return 0
    limit = bins.load.mean() * (1.0 + tolerance)
    members = None
    for rounds in range(max_rounds):
        over = int(np.count_nonzero(bins.load > limit))
        if over == 0:
            return rounds
        members = members or Members(bins.rank_of, num_ranks)
        order = np.argsort(bins.load, kind="stable")
        heavy_all = order[::-1][:min(over, num_ranks // 2)]
        per_pair = max(1, int(members.count[heavy_all].max()) * int(members.count[order[:num_ranks // 2]].max()))
        pairs = max(1, BUDGET // per_pair)
        n_heavy = max(1, min(len(heavy_all), int(np.sqrt(pairs))))
        n_light = max(n_heavy, min(num_ranks - n_heavy, pairs // n_heavy))
        heavy, light = heavy_all[:n_heavy], order[:n_light]
        score, improves, is_swap, i, j = _best_actions(bins, members, np.repeat(heavy, n_light), np.tile(light, n_heavy))
        if not improves.any():
            return rounds + 1
        score = np.where(improves, score, np.inf).reshape(n_heavy, n_light)
        ranked = np.argsort(score, axis=1, kind="stable").tolist()
        finite = np.isfinite(score).tolist()
        if not any(finite[0]):
            return rounds + 1  # the most loaded rank cannot shed load: the maximum is final
        taken, chosen = set(), []
        for h, row in enumerate(ranked):  # heaviest first: its best partner nobody took yet
            for c in row:
                if not finite[h][c]:
                    break
                if c not in taken:
                    taken.add(c)
                    chosen.append(h * n_light + c)
                    break
        pick = np.array(chosen, dtype=np.int64)
        _apply(bins, members, np.repeat(heavy, n_light)[pick], np.tile(light, n_heavy)[pick],
               is_swap[pick], i[pick], j[pick])
    return max_rounds
