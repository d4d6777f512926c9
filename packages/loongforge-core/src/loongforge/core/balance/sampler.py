"""The balanced distributed batch sampler: each DP rank yields its own planned micro-batches.

Every rank holds the lengths of all samples (from the dataset index, no data), draws the same
epoch permutation, cuts it into steps of ``samples_per_step`` global samples, plans each step
with ``plan_step`` and yields only its own micro-batches as lists of dataset indices. All ranks
compute the same plan, so the ranks' samples of a step are a partition of the step, and over an
epoch every sample (but the ``len % samples_per_step`` dropped at the end) is used exactly once.

Use it as a ``torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``: the
collate function receives one micro-batch (a packed sequence of up to ``token_cap`` tokens). A
rank's number of micro-batches varies from step to step; ``step_batches(loader)`` groups the
loader's output back into steps, and ``plan_for_step(step)`` says what any step holds.

The position is the number of global samples consumed (a multiple of ``samples_per_step``), so
resuming from ``state_dict()`` replays exactly the steps not yet trained, for any DP size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Sampler

from loongforge.core.balance.cost import CostModel, SampleLength, SampleSizes
from loongforge.core.balance.metrics import BalanceMetrics
from loongforge.core.balance.solver import plan_step
from loongforge.core.errors import DataError

_CACHED_PLANS = 16  # steps a DataLoader may read ahead without re-planning


@dataclass(frozen=True)
class RankStep:
    """One rank's share of one step."""

    step: int  # global step number since the start of training
    epoch: int
    micro_batches: list[list[int]]  # dataset indices, one list per micro-batch
    sizes: SampleSizes  # this rank's samples (for CostFitter.add_sizes)
    metrics: BalanceMetrics

    @property
    def indices(self) -> list[int]:
        return [i for mb in self.micro_batches for i in mb]


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields this DP rank's micro-batches (lists of dataset indices), step after step, to the end of the epoch.

    ``lengths[i]``: sample i's token count, or its list of segment lengths (a pre-packed sample).
    ``samples_per_step``: global samples per optimizer step (the global batch size), at least
    ``dp_size``. ``token_cap`` and ``max_micro_batches`` bound each micro-batch and each rank
    (see ``plan_step``). ``skip_threshold``: keep the plain contiguous split when its
    max/mean rank cost is at most this.
    """

    def __init__(
        self,
        lengths: Sequence[SampleLength] | np.ndarray | SampleSizes,
        *,
        samples_per_step: int,
        dp_rank: int,
        dp_size: int,
        cost_model: CostModel,
        token_cap: int | None = None,
        max_micro_batches: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        skip_threshold: float = 1.02,
        consumed_samples: int = 0,
    ):
        self.sizes = lengths if isinstance(lengths, SampleSizes) else SampleSizes.from_lengths(lengths)
        n = len(self.sizes)
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in 0..dp_size-1 (dp_size={dp_size})")
        if samples_per_step < dp_size:
            raise ValueError(f"samples_per_step={samples_per_step} must be >= dp_size={dp_size} (one sample per rank at least)")
        if n < samples_per_step:  # a data error (one error line), as the CLIs report it
            raise DataError(f"the dataset has {n} samples, fewer than samples_per_step={samples_per_step} (one "
                            f"step's samples, train.global_batch_size)")
        if token_cap is not None:
            too_long = np.flatnonzero(self.sizes.tokens > token_cap)
            if too_long.size:
                i = int(too_long[0])
                raise DataError(
                    f"dataset sample {i} has {int(self.sizes.tokens[i])} tokens, more than token_cap={token_cap}; "
                    f"{too_long.size} sample(s) exceed it: truncate or split them in preprocessing, or raise token_cap"
                )
        self.samples_per_step = samples_per_step
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.token_cap, self.max_micro_batches = token_cap, max_micro_batches
        self.shuffle, self.seed = shuffle, seed
        self.skip_threshold = skip_threshold
        self.steps_per_epoch = n // samples_per_step
        self._perm_epoch = -1
        self._perm: np.ndarray = np.arange(0)  # the permutation of epoch _perm_epoch
        self._plans: OrderedDict[int, RankStep] = OrderedDict()
        self.set_cost_model(cost_model)
        self._consumed = 0
        self.load_state_dict({"consumed_samples": consumed_samples})

    # -- configuration -----------------------------------------------------------------------
    def set_cost_model(self, cost_model: CostModel) -> None:
        """Use new coefficients from the next planned step on (every rank must set the same ones)."""
        self.cost_model = cost_model
        self._costs = cost_model.costs(self.sizes)
        self._plans.clear()

    # -- position ----------------------------------------------------------------------------
    @property
    def consumed_samples(self) -> int:
        return self._consumed

    @property
    def next_step(self) -> int:
        return self._consumed // self.samples_per_step

    def state_dict(self, consumed_samples: int | None = None) -> dict[str, Any]:
        """The position, by default after the last step handed out in full.

        A DataLoader with workers asks the sampler ahead of training; pass the trainer's own count
        of consumed global samples then.
        """
        consumed = self._consumed if consumed_samples is None else int(consumed_samples)
        return {"consumed_samples": consumed, "samples_per_step": self.samples_per_step, "seed": self.seed,
                "shuffle": self.shuffle, "num_samples": len(self.sizes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("samples_per_step", "seed", "shuffle", "num_samples"):
            if key in state and state[key] != mine[key]:
                raise ValueError(f"sampler state {key}={state[key]!r} does not match this sampler's {key}={mine[key]!r}")
        consumed = int(state["consumed_samples"])
        if consumed < 0 or consumed % self.samples_per_step:
            raise ValueError(
                f"sampler state consumed_samples={consumed} is not a non-negative multiple of "
                f"samples_per_step={self.samples_per_step}"
            )
        self._consumed = consumed

    # -- plans -------------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            n = len(self.sizes)
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._perm_epoch = epoch
        return self._perm

    def plan_for_step(self, step: int) -> RankStep:
        """This rank's micro-batches of global step ``step`` (a pure function of the step)."""
        if step in self._plans:
            return self._plans[step]
        epoch, k = divmod(step, self.steps_per_epoch)
        s = self.samples_per_step
        idx = self._permutation(epoch)[k * s:(k + 1) * s]
        plan = plan_step(self._costs[idx], self.sizes.tokens[idx], self.dp_size, token_cap=self.token_cap,
                         max_micro_batches=self.max_micro_batches, skip_threshold=self.skip_threshold)
        micro = [idx[np.asarray(mb, dtype=np.int64)].tolist() for mb in plan.micro_batches(self.dp_rank)]
        mine = idx[plan.rank == self.dp_rank]
        result = RankStep(step=step, epoch=epoch, micro_batches=micro, sizes=self.sizes.take(mine),
                          metrics=plan.metrics)
        self._plans[step] = result
        while len(self._plans) > _CACHED_PLANS:
            self._plans.popitem(last=False)
        return result

    def steps(self) -> Iterator[RankStep]:
        """This rank's steps from the current position to the end of its epoch (advances the position)."""
        first = self.next_step
        end = (first // self.steps_per_epoch + 1) * self.steps_per_epoch
        for step in range(first, end):
            planned = self.plan_for_step(step)
            self._consumed = (step + 1) * self.samples_per_step
            yield planned

    def __iter__(self) -> Iterator[list[int]]:
        """Micro-batches to the end of the epoch; a step counts as consumed with its last micro-batch."""
        first = self.next_step
        end = (first // self.steps_per_epoch + 1) * self.steps_per_epoch
        for step in range(first, end):
            micro_batches = self.plan_for_step(step).micro_batches
            yield from micro_batches[:-1]
            self._consumed = (step + 1) * self.samples_per_step
            yield micro_batches[-1]


def step_batches(loader: DataLoader) -> Iterator[tuple[list[Any], RankStep]]:
    """Group the micro-batches of a DataLoader over a ``BalancedBatchSampler`` into steps, epoch after epoch.

    Yields ``(collated micro-batches of this rank, RankStep)`` per step, forever; the trainer
    stops when it has run its steps.
    """
    sampler = loader.batch_sampler
    if not isinstance(sampler, BalancedBatchSampler):
        raise TypeError(f"step_batches needs a DataLoader with batch_sampler=BalancedBatchSampler, got {type(sampler).__name__}")
    while True:
        first = sampler.next_step
        end = (first // sampler.steps_per_epoch + 1) * sampler.steps_per_epoch
        batches = iter(loader)
        for step in range(first, end):
            planned = sampler.plan_for_step(step)
            yield [next(batches) for _ in planned.micro_batches], planned
