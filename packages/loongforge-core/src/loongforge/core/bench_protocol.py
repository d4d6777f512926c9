"""The protocol every ``lf-* bench`` follows against its baseline:

- both sides start from the same weights and data, and their first-step losses must agree to a
  tolerance suited to the precision (``check_first_losses``: ``FirstLossMismatch`` otherwise);
- the runs alternate order round by round (baseline first, then ours first, ...:
  ``alternating_orders``), and a run's step time is the median over all its timed steps;
- ``--processes N`` repeats the whole bench in N fresh processes, one after the other
  (``in_fresh_processes``), and ``spread_lines`` prints each run's median and spread across them,
  for a baseline whose step time varies from process to process;
- ``run_rounds`` runs the sides (``Side``: the baseline's step, ours) round by round, each built
  afresh and released after its steps; ours is ``training_step``: ``Trainer.train_step`` of the
  task ``lf-X train`` trains, on the engine it builds.
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a bench runs, not where the CLI builds its options
    import torch

DEFAULT_ROUNDS = 2  # baseline first, then ours first


class FirstLossMismatch(AssertionError):
    """A run's first-step loss is not the baseline's: the two sides do not train the same thing."""


def first_loss_tolerance(dtype: torch.dtype, fp8: bool = False) -> float:
    """Relative tolerance of first-step losses: 1e-4 in fp32, 5e-2 in bf16/fp16 or with FP8 GEMMs
    (one side's bf16 rounding differs from the other's where they fuse differently)."""
    import torch

    return 1e-4 if dtype == torch.float32 and not fp8 else 5e-2


def losses_agree(a: float, b: float, tolerance: float) -> bool:
    """``|a - b| <= tolerance * |a|`` (and both finite)."""
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tolerance * max(abs(a), 1e-6)


def check_first_losses(losses: Mapping[str, float], reference: str, dtype: torch.dtype,
                       fp8_runs: Sequence[str] = ()) -> list[str]:
    """The lines that report every run's first-step loss against ``reference``'s; raises
    ``FirstLossMismatch`` naming every run that disagrees beyond ``first_loss_tolerance``."""
    ref = losses[reference]
    lines, bad = [], []
    for name, loss in losses.items():
        tol = first_loss_tolerance(dtype, fp8=name in fp8_runs)
        ok = losses_agree(ref, loss, tol)
        lines.append(f"first-step loss {name}: {loss:.6f} ({'agrees with' if ok else 'DISAGREES with'} "
                     f"{reference} {ref:.6f}, tolerance {tol:g} relative)")
        if not ok:
            bad.append(f"{name} {loss:.6f}")
    if bad:
        raise FirstLossMismatch(f"first-step losses disagree with {reference}'s ({ref:.6f}, {dtype}): " + ", ".join(bad))
    return lines


def alternating_orders(baselines: Sequence[str], ours: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of the runs in each of ``rounds`` rounds: the baselines first in even rounds, ours
    first in odd ones, so neither side always runs on a cold (or a warm) device."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: at least one round")
    return [[*baselines, *ours] if r % 2 == 0 else [*ours, *baselines] for r in range(rounds)]


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of ``values``: how far apart the repeats of one measurement are."""
    return (max(values) - min(values)) / statistics.median(values)


# -- --processes N ----------------------------------------------------------------------------
def _child(target: Callable[..., object], kwargs: dict, path: str) -> None:
    Path(path).write_text(json.dumps(target(**kwargs)))


def in_fresh_process(target: Callable[..., Any], kwargs: dict) -> Any:
    """``target(**kwargs)`` (a module-level function returning JSON-able data) in a fresh (spawned)
    process, e.g. a run whose library changes process-wide state; its result."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(scratch) / "result.json")
        proc = ctx.Process(target=_child, args=(target, kwargs, path))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{getattr(target, '__name__', target)} in a fresh process failed (exit code {proc.exitcode})")
        return json.loads(Path(path).read_text())


def in_fresh_processes(target: Callable[..., Mapping[str, float]], kwargs: dict, processes: int,
                       report: Callable[[str], None] = print) -> list[dict[str, float]]:
    """``target(**kwargs)`` (a module-level function returning run name -> seconds per step) in
    ``processes`` fresh (spawned) processes, one after the other; each one's result."""
    out = []
    for i in range(processes):
        report(f"-- process {i + 1} of {processes}")
        out.append(dict(in_fresh_process(target, kwargs)))
    return out


def repeat_in_processes(target: Callable[..., Mapping[str, float]], kwargs: dict, processes: int,
                        baselines: Sequence[str], report: Callable[[str], None] = print) -> None:
    """``--processes N``: the bench (``target(**kwargs)``, run name -> seconds per step) in ``N``
    fresh processes, then each run's median and spread over them and its ratio to each of
    ``baselines`` that ran."""
    per_process = in_fresh_processes(target, kwargs, processes, report)
    report("\n".join(spread_lines(per_process, [b for b in baselines if b in per_process[0]])))


def spread_lines(per_process: Sequence[Mapping[str, float]], baselines: Sequence[str]) -> list[str]:
    """Per run: the median, min and max seconds per step over the processes and their spread, then
    the ratio of each baseline's median to the run's (the speed-up over that baseline)."""
    names = list(per_process[0])
    lines = [f"{'run':<22}{'median ms':>11}{'min':>9}{'max':>9}{'spread':>8}" + "".join(f"{'x ' + b:>18}" for b in baselines)]
    for name in names:
        values = [p[name] for p in per_process]
        ratios = "".join(f"{statistics.median([p[b] for p in per_process]) / statistics.median(values):>18.2f}" for b in baselines)
        lines.append(f"{name:<22}{statistics.median(values) * 1e3:>11.1f}{min(values) * 1e3:>9.1f}{max(values) * 1e3:>9.1f}"
                     f"{spread(values):>8.1%}{ratios}")
    return lines


# -- one run's timed steps ----------------------------------------------------------------------
def timed_steps(step: Callable[[], Any], steps: int, warmup: int,
                synchronize: Callable[[], None]) -> tuple[float, list[float]]:
    """The first step's loss (``float`` of what the first call returns: the loss before any
    update; that call also compiles where compiled), ``warmup - 1`` more untimed calls, then the
    seconds of each of ``steps`` timed calls (host clock, synchronised after each)."""
    from loongforge.core.benchmarking import timed_calls

    first = float(step())
    for _ in range(max(warmup - 1, 0)):
        step()
    return first, timed_calls(step, steps, synchronize)


def check_protocol(rounds: int, processes: int) -> None:
    """``--rounds`` and ``--processes``: at least one of each."""
    from loongforge.core.config import ConfigError

    if rounds < 1 or processes < 1:
        raise ConfigError(f"--rounds {rounds} --processes {processes}: at least one round and one process")


def add_protocol_arguments(parser, rounds: int = DEFAULT_ROUNDS) -> None:
    """``--rounds`` and ``--processes``, the options every bench shares beyond the CLI's own."""
    parser.add_argument("--rounds", type=int, default=rounds,
                        help=f"rounds of all runs, alternating baseline first / ours first (default {rounds})")
    parser.add_argument("--processes", type=int, default=1,
                        help="repeat the bench in this many fresh processes and print each run's median and spread")


# -- the runs of a bench ----------------------------------------------------------------------
@dataclass
class Side:
    """One run of a bench: ``start()`` builds it on the device and returns its step (a call that
    trains one step and returns that step's loss, before its update) and a ``release()`` that
    hands back what outlives the run (e.g. a baseline model kept on the host between rounds; what
    only the step holds is dropped with it); ``tf32`` turns on TF32 matmuls around it (a baseline
    whose recipe asks for it)."""

    name: str
    start: Callable[[], tuple[Callable[[], object], Callable[[], None]]]
    tf32: bool = False


@dataclass
class SideTimes:
    """A run's measurements over every round: the first round's first-step loss, every timed
    step's seconds, and the largest peak of allocated device memory (NaN on the CPU)."""

    name: str
    first_loss: float
    seconds: list[float]
    peak_gib: float

    @property
    def step_s(self) -> float:
        return statistics.median(self.seconds)


def free_device_memory(accel) -> None:
    """What a finished run left: collected, and the device allocator's cache emptied."""
    import torch

    gc.collect()
    if accel.device().type == "cuda":
        torch.cuda.empty_cache()


def run_rounds(sides: Sequence[Side], baselines: Sequence[str], rounds: int, steps: int, warmup: int,
               report: Callable[[str], None] = print) -> dict[str, SideTimes]:
    """Every side in ``rounds`` rounds of ``alternating_orders`` (``baselines``, the names of the
    baseline sides, first in even rounds): each run built afresh (``Side.start``), its first step
    (the loss reported), ``warmup - 1`` more, then ``steps`` timed ones (``timed_steps``), and
    released before the next; a side's times gather over the rounds."""
    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.baseline_recipe import tf32_matmuls

    accel = get_accelerator()
    tracks_memory = accel.device().type != "cpu"
    by_name = {s.name: s for s in sides}
    out: dict[str, SideTimes] = {}
    ours = [s.name for s in sides if s.name not in baselines]
    for r, order in enumerate(alternating_orders([b for b in baselines if b in by_name], ours, rounds)):
        report(f"round {r + 1} of {rounds}: {', '.join(order)}")
        for name in order:
            side = by_name[name]
            if tracks_memory:
                accel.reset_peak_memory_stats()
            with tf32_matmuls(side.tf32):
                step, release = side.start()
                try:
                    first, seconds = timed_steps(step, steps, warmup, accel.synchronize)
                    peak = accel.memory_stats().peak_allocated / 2**30 if tracks_memory else float("nan")
                finally:
                    release()
                    del step, release
                    free_device_memory(accel)
            if name in out:
                out[name].seconds += seconds
                out[name].peak_gib = max(out[name].peak_gib, peak)
            else:
                out[name] = SideTimes(name, first, list(seconds), peak)
            report(f"  {name}: {statistics.median(seconds) * 1e3:.1f} ms/step (median of {len(seconds)}), "
                   f"first-step loss {first:.5f}")
    return {s.name: out[s.name] for s in sides}


@contextmanager
def bench_world(seed: int):
    """The process groups ``lf-X train`` makes for a world of one (``init_parallel``), as a bench's
    trainers need them; torn down afterwards when this made them (a process already in a group
    stays in it)."""
    import torch.distributed as dist

    from loongforge.core.parallel import destroy_parallel, init_parallel

    owned = not dist.is_initialized()
    ctx = init_parallel(seed=seed)
    try:
        yield ctx
    finally:
        if owned:
            destroy_parallel()


def bench_run_config(cfg, run_dir: str):
    """A copy of the run config ``cfg`` for a bench's trainer: its run directory ``run_dir`` (a
    scratch one), no resume, no checkpoint (``checkpoint.load`` and the rest as the config says)."""
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.log.run_dir = run_dir
    cfg.checkpoint.dir = None
    cfg.checkpoint.resume = False
    cfg.checkpoint.save = False
    return cfg


def training_step(task, ctx, cfg, step_batch=None):
    """Ours in a bench: ``task`` trained by ``Trainer.train_step`` on the engine ``lf-X train``
    builds for ``cfg`` (its precision, compilation, recomputation, optimizer), on ``step_batch`` or,
    when None, on the task's own first step (``task.prepare(ctx)`` then ``task.steps(ctx, 0)``: the
    data ``lf-X train`` trains on). Returns the step (its loss, before the update) and the trainer;
    ``cfg`` neither resumes nor saves (``bench_run_config``)."""
    from loongforge.core.training.loop import Trainer

    if step_batch is None:
        task.prepare(ctx)
        step_batch = next(iter(task.steps(ctx, 0)))
    trainer = Trainer(task, ctx, cfg, report=lambda line: None)

    def step() -> float:
        return trainer.train_step(step_batch).loss

    return step, trainer
