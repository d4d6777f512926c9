"""What the balancer reports per step: rank-cost imbalance before and after the plan."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def imbalance(rank_costs: np.ndarray) -> float:
    """max / mean of the ranks' costs (1.0 is perfect; the slowest rank sets the step time)."""
    costs = np.asarray(rank_costs, dtype=np.float64)
    mean = float(costs.mean()) if costs.size else 0.0
    return float(costs.max()) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class BalanceMetrics:
    """One step's balance: the plain contiguous assignment ("before") against the plan ("after").

    ``efficiency_*`` is mean/max rank cost, the fraction of ideal DP scaling a compute-bound step
    reaches. ``rebalanced`` is False when the plain assignment was kept (already balanced within
    the skip threshold, or the solver could not beat it). ``solver_ms`` is wall time and so is not
    part of equality.
    """

    imbalance_before: float
    imbalance_after: float
    max_cost_before: float
    max_cost_after: float
    mean_cost: float
    rebalanced: bool
    solver_ms: float = field(default=0.0, compare=False)

    @property
    def efficiency_before(self) -> float:
        return 1.0 / self.imbalance_before

    @property
    def efficiency_after(self) -> float:
        return 1.0 / self.imbalance_after

    def as_dict(self, prefix: str = "balance/") -> dict[str, float]:
        """Flat scalars for ``MetricsLogger.log``."""
        return {
            f"{prefix}imbalance_before": self.imbalance_before,
            f"{prefix}imbalance_after": self.imbalance_after,
            f"{prefix}efficiency_after": self.efficiency_after,
            f"{prefix}rebalanced": float(self.rebalanced),
            f"{prefix}solver_ms": self.solver_ms,
        }
