"""DP load balancing: every DP rank gets about the same compute per step.

- ``cost``: per-sample cost ``a*sum(segment_length**2) + b*tokens + c``; coefficients from a FLOP
  formula (``transformer_cost_model``, ``CostModel.from_flops_per_token``).
- ``fit`` / ``distributed``: least-squares coefficients from measured warm-up step times, pooled
  over ranks and broadcast from one (``CostFitter``, ``fit_and_broadcast``).
- ``solver``: ``plan_step`` assigns one step's samples to ranks and micro-batches (largest-first
  greedy, move/swap refinement, token caps), the same on every rank.
- ``sampler``: ``BalancedBatchSampler`` for ``DataLoader(batch_sampler=...)`` with an exact,
  resumable position; ``step_batches`` groups the loader's micro-batches into steps.
- ``metrics``: ``BalanceMetrics``, the per-step imbalance before and after.
"""

from loongforge.core.balance.cost import CostModel, SampleSizes, transformer_cost_model
from loongforge.core.balance.distributed import broadcast_cost_model, fit_and_broadcast
from loongforge.core.balance.fit import CostFit, CostFitter
from loongforge.core.balance.metrics import BalanceMetrics, imbalance
from loongforge.core.balance.packing import PlanError
from loongforge.core.balance.sampler import BalancedBatchSampler, RankStep, step_batches
from loongforge.core.balance.solver import Plan, plan_step

__all__ = [
    "BalanceMetrics", "BalancedBatchSampler", "CostFit", "CostFitter", "CostModel", "Plan", "PlanError",
    "RankStep", "SampleSizes", "broadcast_cost_model", "fit_and_broadcast", "imbalance", "plan_step",
    "step_batches", "transformer_cost_model",
]
