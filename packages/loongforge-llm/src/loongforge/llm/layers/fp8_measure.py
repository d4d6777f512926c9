"""Measuring ``fp8=adaptive``'s plan once, at the start of a run, and agreeing it over the ranks.

What is timed is what the run will call: the registry's ``fp8_linear`` (resolved by the run's
``KernelPolicy``), forward and backward at ``tokens x in_features -> out_features`` in the
run's parameter dtype, once per combination of GEMMs in FP8 (:data:`fp8_plan.COMBINATIONS`), so
a choice pays for everything its GEMMs need (e.g. the weight quantised once for both fprop and
dgrad). Where ``fp8_linear`` resolves to its torch reference (no fused FP8 kernel on the device:
a CPU, a GPU older than sm_89, ``kernels.force_reference``), there is no FP8 GEMM to time and
``fp8=adaptive`` is refused.

Every rank takes part, in this order: the union of the ranks' shapes (``all_gather_object``),
each rank times every shape of it in every combination, each time becomes its maximum over the
ranks (``all_reduce`` MAX: exact, so every rank holds the same numbers) and every rank picks the
fastest combination from those numbers (``fp8_plan.fastest``, ties to fewer FP8 GEMMs). So every
rank ends with the same plan, chosen for the slowest rank. Without a process group (or in a world
of one) nothing distributed happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from loongforge.core.config import ConfigError
from loongforge.core.kernels import KernelPolicy, get_op
from loongforge.core.kernels.fp8_format import Fp8Gemms
from loongforge.llm.layers.fp8_plan import COMBINATIONS, FP8Plan, ShapePlan, fastest

# (tokens, out_features, in_features, gemms) -> ms of one forward+backward of that linear
Timer = Callable[[int, int, int, Fp8Gemms], float]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shapes_of_all_ranks(shapes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sorted union of every rank's ``shapes`` (a collective over the default group)."""
    local = sorted({(int(o), int(i)) for o, i in shapes})
    if not _distributed():
        return local
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return sorted({tuple(s) for part in everyone for s in part})


def slowest_over_ranks(times: Sequence[Sequence[float]], device: torch.device | None = None) -> list[list[float]]:
    """Each of ``times`` replaced by its maximum over the ranks (every rank passes the same layout;
    ``device``: where the default group's backend takes tensors)."""
    rows = [list(row) for row in times]
    if not _distributed() or not rows:
        return rows
    agreed = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return agreed.tolist()


def measure_fp8_plan(shapes: Sequence[tuple[int, int]], tokens: int, timer: Timer,
                     device: torch.device | None = None) -> FP8Plan:
    """The plan for ``shapes`` (every rank the same list: :func:`shapes_of_all_ranks`): ``timer``
    times each in every combination at ``tokens`` tokens, the times are agreed over the ranks
    (:func:`slowest_over_ranks`) and each shape gets the fastest combination."""
    local = [[float(timer(tokens, out_features, in_features, gemms)) for gemms in COMBINATIONS]
             for out_features, in_features in shapes]
    agreed = slowest_over_ranks(local, device)
    return FP8Plan(tuple(ShapePlan(o, i, fastest(ms), tokens, tuple(ms)) for (o, i), ms in zip(shapes, agreed)))


def fused_fp8_linear(kernels: KernelPolicy) -> bool:
    """Whether ``kernels`` resolves ``fp8_linear`` to a fused implementation (real FP8 GEMMs)
    rather than its torch reference."""
    return kernels.get("fp8_linear") is not get_op("fp8_linear").reference


def check_adaptive_fp8(kernels: KernelPolicy, key: str = "fp8") -> None:
    """A ``ConfigError`` where there is no FP8 GEMM to time for ``fp8=adaptive``."""
    if not fused_fp8_linear(kernels):
        raise ConfigError(
            f"{key}=adaptive: fp8_linear runs its torch reference here (FP8 emulated in fp32), so there is no FP8 "
            "GEMM to time; adaptive needs loongforge-kernels on a CUDA GPU of compute capability 8.9+ (and "
            "kernels.force_reference=false). Use fp8=blockwise, or resume a run whose checkpoint holds its fp8_plan")


def registry_linear_timer(kernels: KernelPolicy, dtype: torch.dtype, device: torch.device,
                          synchronize: Callable[[], None], reps: int = 10, warmup: int = 3) -> Timer:
    """A :data:`Timer` of the registry's ``fp8_linear`` as ``kernels`` resolves it: mean wall ms of
    ``reps`` forward+backward calls after ``warmup`` untimed ones, ``synchronize`` (the
    accelerator's) around them. Inputs are ``dtype`` on ``device``, drawn from a generator of its
    own (the run's random streams are left as they are). Refuses where there is nothing to time
    (:func:`check_adaptive_fp8`)."""
    check_adaptive_fp8(kernels)
    op = kernels.get("fp8_linear")

    def timer(tokens: int, out_features: int, in_features: int, gemms: Fp8Gemms) -> float:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, in_features, generator=g, device=device, dtype=dtype).requires_grad_()
        w = (torch.randn(out_features, in_features, generator=g, device=device, dtype=dtype)
             * in_features**-0.5).requires_grad_()
        dy = torch.randn(tokens, out_features, generator=g, device=device, dtype=dtype)

        def step():
            torch.autograd.grad(op(x, w, None, gemms=gemms), (x, w), dy)

        for _ in range(warmup):
            step()
        synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            step()
        synchronize()
        return (time.perf_counter() - start) * 1e3 / reps

    return timer
