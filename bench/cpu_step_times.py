"""Measured step times of DP sample assignments: a 2-process (or more) gloo run on CPU.

Each process is one DP rank. A step's samples are assigned to the ranks by one policy; every rank
runs a transformer-like workload on its samples (``CpuWorkload``: GEMMs linear in a sample's
length, attention quadratic in it) and then joins an all-reduce, as data-parallel gradients do,
so a step lasts as long as its slowest rank. Policies:

- ``plain``: each rank takes the next contiguous ``samples_per_step / DP`` samples of the step
  (what a distributed sampler does);
- ``lpt``: largest-first greedy on the workload's cost model;
- ``balanced``: ``BalancedBatchSampler`` (``plan_step``) with the same cost model.

The policies take turns step by step, in a rotating order, on the same steps' samples.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from balance_baselines import lpt_assignment
from loongforge.core.balance.cost import CostModel, SampleSizes
from loongforge.core.balance.sampler import BalancedBatchSampler
from loongforge.core.distributed import free_port

POLICIES = ("plain", "lpt", "balanced")


@dataclass(frozen=True)
class CpuWorkload:
    """Per sample of L tokens: ``gemms`` [L, width] x [width, width] products and one attention
    (``x x^T`` then its product with ``x``); FLOPs ``4*width*L**2 + 2*gemms*width**2*L``."""

    width: int = 64
    gemms: int = 8

    def cost_model(self) -> CostModel:
        return CostModel(a=4.0 * self.width, b=2.0 * self.gemms * self.width**2)

    def run(self, lengths: list[int], weight: torch.Tensor, pool: torch.Tensor) -> float:
        """The work of ``lengths``' samples, each rounded up to a multiple of 32 tokens (so that few
        distinct shapes occur; ``warm_up`` runs each of them once before the timing)."""
        total = 0.0
        for n in lengths:
            x = pool[:-(-n // 32) * 32]
            for _ in range(self.gemms):
                x = torch.tanh(x @ weight)
            total += float(((x @ x.T) @ x)[0, 0])
        return total


def _assignment(policy: str, step_lengths: np.ndarray, sampler: BalancedBatchSampler, step: int, rank: int,
                world: int, cost: CostModel) -> list[int]:
    """Positions (within the step) of ``rank``'s samples under ``policy``."""
    n = len(step_lengths)
    if policy == "plain":
        per = n // world
        return list(range(rank * per, (rank + 1) * per))
    if policy == "lpt":
        rank_of = lpt_assignment(cost.costs(SampleSizes.from_lengths(step_lengths)), world)
        return np.flatnonzero(rank_of == rank).tolist()
    return [i - step * n for i in sampler.plan_for_step(step).indices]


def _worker(rank: int, world: int, port: int, lengths: list[int], samples_per_step: int, steps: int,
            workload: CpuWorkload, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cost = workload.cost_model()
        all_lengths = np.asarray(lengths, dtype=np.int64)
        sampler = BalancedBatchSampler(all_lengths, samples_per_step=samples_per_step, dp_rank=rank, dp_size=world,
                                       cost_model=cost, shuffle=False)
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(workload.width, workload.width, generator=g) / workload.width**0.5
        pool = torch.randn(int(all_lengths.max()), workload.width, generator=g)
        flag = torch.zeros(1)
        times: dict[str, list[float]] = {p: [] for p in POLICIES}
        pool = torch.cat([pool, pool[:32]])  # room for the rounding up
        workload.run(sorted({-(-int(n) // 32) * 32 for n in all_lengths[:steps * samples_per_step]}), weight, pool)
        for step in range(steps):
            step_lengths = all_lengths[step * samples_per_step:(step + 1) * samples_per_step]
            for j in range(len(POLICIES)):
                policy = POLICIES[(step + j) % len(POLICIES)]
                mine = _assignment(policy, step_lengths, sampler, step, rank, world, cost)
                dist.barrier()
                t0 = time.perf_counter()
                workload.run([int(step_lengths[i]) for i in mine], weight, pool)
                dist.all_reduce(flag)  # the step ends when the slowest rank is done
                times[policy].append(time.perf_counter() - t0)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def measure_step_times(lengths: np.ndarray, samples_per_step: int, steps: int, world: int = 2,
                       workload: CpuWorkload = CpuWorkload()) -> dict[str, list[float]]:
    """Seconds of each of ``steps`` steps (the first ``steps * samples_per_step`` of ``lengths``,
    in order) under each policy, from a ``world``-process gloo run on CPU."""
    import tempfile

    import torch.multiprocessing as mp

    if len(lengths) < steps * samples_per_step:
        raise ValueError(f"{len(lengths)} lengths for {steps} steps of {samples_per_step} samples")
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "times.json")
        mp.spawn(_worker, args=(world, free_port(), [int(n) for n in lengths], samples_per_step, steps, workload, out),
                 nprocs=world, join=True)
        return json.loads(Path(out).read_text())
