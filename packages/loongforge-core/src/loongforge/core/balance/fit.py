"""Fit the cost model to measured step times (least squares with non-negative coefficients).

During warm-up every DP rank records, per step, the sizes of the samples it computed and the
seconds its forward and backward took (before the gradient all-reduce, which waits for the
slowest rank). The model is

    seconds = a * sum(segment_length**2) + b * tokens + c * samples + overhead

where ``overhead`` is the per-step time no sample causes (it is the same on every rank, so it
does not move the balance and is reported, not used). ``CostFitter`` keeps only the normal
equations (a 4x4 matrix and two vectors), so measurements stream in and fitters of several ranks
add up (``fit_and_broadcast`` in ``loongforge.core.balance.distributed`` does that over the DP
group). Negative coefficients have no meaning here; the fit is the exact non-negative least
squares solution, found by solving every support set of the four features.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import numpy as np

from loongforge.core.balance.cost import CostModel, SampleSizes

FEATURES = ("a", "b", "c", "overhead")  # coefficient of squares, tokens, samples, 1


@dataclass(frozen=True)
class CostFit:
    model: CostModel
    overhead: float  # per-step seconds not tied to samples
    rms_error: float  # root-mean-square residual, seconds
    num_measurements: int


class CostFitter:
    """Streams (rank sizes, seconds) measurements; ``fit()`` returns the least-squares CostFit."""

    def __init__(self, *, fit_overhead: bool = True):
        self.fit_overhead = fit_overhead
        self.xtx: np.ndarray = np.zeros((4, 4), dtype=np.float64)
        self.xty: np.ndarray = np.zeros(4, dtype=np.float64)
        self.yty = 0.0
        self.count = 0

    def add(self, squares: float, tokens: float, samples: float, seconds: float) -> None:
        """One rank-step: sum of segment length², total tokens, number of samples, seconds."""
        values = (squares, tokens, samples, seconds)
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"measurement (squares, tokens, samples, seconds)={values} must be finite and >= 0")
        x = np.array([squares, tokens, samples, 1.0], dtype=np.float64)
        self.xtx += np.outer(x, x)
        self.xty += x * seconds
        self.yty += float(seconds) ** 2
        self.count += 1

    def add_sizes(self, sizes: SampleSizes, seconds: float) -> None:
        """The samples one rank computed in one step (all its micro-batches) and its seconds."""
        self.add(float(sizes.squares.sum()), float(sizes.tokens.sum()), float(len(sizes)), seconds)

    # -- merging across ranks --------------------------------------------------------------
    def statistics(self) -> np.ndarray:
        """The sufficient statistics as one flat float64 vector (summable across ranks)."""
        return np.concatenate([self.xtx.ravel(), self.xty, [self.yty, float(self.count)]])

    def load_statistics(self, stats: np.ndarray) -> None:
        stats = np.asarray(stats, dtype=np.float64)
        if stats.shape != (22,):
            raise ValueError(f"cost-fit statistics must have shape (22,), got {stats.shape}")
        self.xtx = stats[:16].reshape(4, 4).copy()
        self.xty = stats[16:20].copy()
        self.yty = float(stats[20])
        self.count = int(round(stats[21]))

    # -- the fit ---------------------------------------------------------------------------
    def fit(self) -> CostFit:
        columns = [0, 1, 2, 3] if self.fit_overhead else [0, 1, 2]
        if self.count < len(columns):
            raise ValueError(f"cost fit needs at least {len(columns)} measurements, has {self.count}")
        norms = np.sqrt(np.diag(self.xtx))
        present = [j for j in columns if norms[j] > 0]
        scale = np.where(norms > 0, norms, 1.0)
        a_mat = self.xtx / np.outer(scale, scale)  # normal equations of the column-scaled problem
        rhs = self.xty / scale
        tol = 1e-10 * max(self.yty, float(np.finfo(np.float64).tiny))
        best_rss: float = np.inf
        best: np.ndarray | None = None
        for size in range(1, len(present) + 1):
            for support in combinations(present, size):
                idx = list(support)
                z = np.linalg.lstsq(a_mat[np.ix_(idx, idx)], rhs[idx], rcond=None)[0]
                if np.any(z < 0):
                    continue
                beta = np.zeros(4)
                beta[idx] = z / scale[idx]
                rss = self.yty - 2 * beta @ self.xty + beta @ self.xtx @ beta
                if rss < best_rss - tol:
                    best_rss, best = rss, beta
        if best is None or (best[0] <= 0 and best[1] <= 0):
            raise ValueError(
                f"the {self.count} measurements do not determine a cost that grows with length "
                f"(fitted a, b, c, overhead = {None if best is None else best.tolist()}); "
                "record more warm-up steps with varied sample lengths"
            )
        model = CostModel(a=float(best[0]), b=float(best[1]), c=float(best[2]))
        rms = float(np.sqrt(max(best_rss, 0.0) / self.count))
        return CostFit(model=model, overhead=float(best[3]), rms_error=rms, num_measurements=self.count)
