"""Balanced steps for the shared trainer: this DP rank's planned micro-batches, step after step.

``BalancedSteps`` is what a task's ``micro_batches`` returns to train with the DP load balancer
(``loongforge.core.balance``). Any modality uses it the same way: hand it a map-style dataset, the
length of every sample (from the dataset index: no sample is read to plan), a collate function
for one micro-batch (the samples of one packed row), and the ``balance`` config group.

Per step, every rank plans the step's ``samples_per_step`` global samples across the DP ranks and
into micro-batches of at most ``token_cap`` tokens (``BalancedBatchSampler``, the same plan on
every rank, nothing sent over the network); this rank's DataLoader then reads only its own
samples. All ranks of one DP replica (its TP, PP and CP ranks) have the same ``dp_rank`` and so
the same micro-batches. Each ``StepBatch`` carries the plan's metrics (rank-cost imbalance
before and after), this replica's token count and the dataset indices it trains.

The cost model is ``balance.coefficients`` or, when those are not given, the model's FLOPs
formula (``CostModel.from_flops_per_token``). With ``balance.fit_steps = N`` the trainer reports
each step's compute seconds (``record_compute_seconds``); after N measured steps (the first step
of a process is warm-up and not measured) the coefficients are fitted by least squares over all
ranks' measurements and broadcast (``fit_and_broadcast``), and later steps are planned with them.
A fit that fails keeps the formula's coefficients, on every rank alike.

``state_dict`` / ``load_state_dict`` hold the position (global samples consumed, a whole number
of steps), the coefficients in use and the fit's progress, so a resumed run plans and reads
exactly the steps it would have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from loongforge.core.balance import (
    BalancedBatchSampler,
    CostFitter,
    CostModel,
    RankStep,
    SampleSizes,
    fit_and_broadcast,
    step_batches,
)
from loongforge.core.training.schema import BalanceConfig
from loongforge.core.training.task import StepBatch


def cost_model_from_config(config: BalanceConfig, flops_per_token: Callable[[int], float] | None) -> CostModel:
    """``balance.coefficients`` when given, else the model's FLOPs formula."""
    if config.coefficients is not None:
        return CostModel(*config.coefficients)
    if flops_per_token is None:
        raise ValueError("balance.coefficients is not set and the task reports no flops_per_token formula")
    return CostModel.from_flops_per_token(flops_per_token)


def _to_device(batch: Any, device: torch.device | None) -> Any:
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class BalancedSteps:
    """Iterator of this DP rank's ``StepBatch`` per optimizer step (see the module docstring)."""

    def __init__(
        self,
        dataset,
        lengths: Sequence[int] | np.ndarray | SampleSizes,
        collate_fn: Callable[[list], Any],
        config: BalanceConfig,
        *,
        samples_per_step: int,
        token_cap: int | None,
        dp_rank: int,
        dp_size: int,
        seed: int,
        flops_per_token: Callable[[int], float] | None = None,
        consumed_samples: int = 0,
        num_workers: int = 0,
        device: torch.device | None = None,
        fit_group=None,
    ):
        self.config = config
        self.samples_per_step = samples_per_step
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device
        self.fit_group = fit_group
        self.sampler = BalancedBatchSampler(
            lengths,
            samples_per_step=samples_per_step,
            dp_rank=dp_rank,
            dp_size=dp_size,
            cost_model=cost_model_from_config(config, flops_per_token),
            token_cap=token_cap,
            max_micro_batches=config.max_micro_batches,
            shuffle=config.shuffle,
            seed=seed,
            skip_threshold=config.skip_threshold if config.enable else float("inf"),
            consumed_samples=consumed_samples,
        )
        self.loader = DataLoader(dataset, batch_sampler=self.sampler, collate_fn=collate_fn, num_workers=num_workers,
                                 pin_memory=device is not None and device.type == "cuda")
        self._handed = consumed_samples // samples_per_step  # steps handed to the trainer
        # made on first use, from the sampler's position
        self._steps: Iterator[tuple[list[Any], RankStep]] | None = None
        self._last: RankStep | None = None
        self._fitter = CostFitter() if config.enable and config.fit_steps else None
        self._measured = 0
        self._warm = False  # the first step of this process has been seen (not measured)
        self._fit_metrics: dict[str, float] = {}

    # -- steps -------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        if self._steps is None:
            self.sampler.load_state_dict({"consumed_samples": self._handed * self.samples_per_step})
            self._steps = step_batches(self.loader)
        micro_batches, planned = next(self._steps)
        self._handed = planned.step + 1
        self._last = planned
        metrics = planned.metrics.as_dict()
        metrics.update(self._fit_metrics)
        self._fit_metrics = {}
        return StepBatch(
            micro_batches=[_to_device(mb, self.device) for mb in micro_batches],
            tokens=int(planned.sizes.tokens.sum()),
            metrics=metrics,
            sample_ids=planned.indices,
        )

    @property
    def cost_model(self) -> CostModel:
        return self.sampler.cost_model

    # -- online fit ----------------------------------------------------------------------------
    @property
    def measuring(self) -> bool:
        """Whether the trainer should report compute seconds (the fit is still collecting)."""
        return self._fitter is not None

    def record_compute_seconds(self, seconds: float) -> None:
        """This rank's forward+backward seconds of the step last handed out (every rank calls this)."""
        if self._fitter is None:
            return
        if not self._warm:
            self._warm = True
            return
        assert self._last is not None  # a step was handed out before its seconds are recorded
        self._fitter.add_sizes(self._last.sizes, seconds)
        self._measured += 1
        if self._measured < self.config.fit_steps:
            return
        try:
            fit = fit_and_broadcast(self._fitter, group=self.fit_group)
        except ValueError:  # raised alike on every rank: keep planning with the current coefficients
            self._fit_metrics = {"balance/fit_ok": 0.0}
        else:
            self.set_cost_model(fit.model)
            self._fit_metrics = {"balance/fit_ok": 1.0, "balance/fit_rms_s": fit.rms_error,
                                 "balance/fit_a": fit.model.a, "balance/fit_b": fit.model.b, "balance/fit_c": fit.model.c}
        self._fitter = None

    def set_cost_model(self, model: CostModel) -> None:
        """Plan the steps not yet handed out with ``model`` (every rank must pass the same)."""
        self.sampler.set_cost_model(model)
        self._steps = None  # a loader with workers may have read ahead under the old plans

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {
            "sampler": self.sampler.state_dict(consumed_samples=self._handed * self.samples_per_step),
            "cost_model": list(self.cost_model.as_tuple()),
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "fit": None,  # None: no fit configured
        }
        if self.config.enable and self.config.fit_steps:
            state["fit"] = {"done": self._fitter is None, "measured": self._measured,
                            "statistics": None if self._fitter is None else self._fitter.statistics().tolist()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: position and coefficients; the fit's measurements when the DP layout is the same."""
        self.sampler.load_state_dict(state["sampler"])
        self._handed = self.sampler.next_step
        self.set_cost_model(CostModel(*state["cost_model"]))
        fit = state.get("fit")
        if fit is None or self._fitter is None:
            return
        if fit["done"]:
            self._fitter = None  # fitted before the checkpoint: its coefficients are the ones just loaded
        elif (state["dp_rank"], state["dp_size"]) == (self.dp_rank, self.dp_size):
            self._fitter.load_statistics(np.asarray(fit["statistics"]))
            self._measured = int(fit["measured"])
