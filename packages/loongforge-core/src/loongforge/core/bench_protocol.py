"""The protocol every ``lf-* bench`` follows against its baseline:

- both sides start from the same weights and data, and their first-step losses must agree to a
  tolerance suited to the precision (``check_first_losses``: ``FirstLossMismatch`` otherwise);
- the runs alternate order round by round (baseline first, then ours first, ...:
  ``alternating_orders``), and a run's step time is the median over all its timed steps;
- ``--processes N`` repeats the whole bench in N fresh processes, one after the other
  (``in_fresh_processes``), and ``spread_lines`` prints each run's median and spread across them,
  for a baseline whose step time varies from process to process.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

DEFAULT_ROUNDS = 2  # baseline first, then ours first


class FirstLossMismatch(AssertionError):
    """A run's first-step loss is not the baseline's: the two sides do not train the same thing."""


def first_loss_tolerance(dtype: torch.dtype, fp8: bool = False) -> float:
    """Relative tolerance of first-step losses: 1e-4 in fp32, 5e-2 in bf16/fp16 or with FP8 GEMMs
    (one side's bf16 rounding differs from the other's where they fuse differently)."""
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


def in_fresh_process(target: Callable[..., object], kwargs: dict) -> object:
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
def timed_steps(step: Callable[[], object], steps: int, warmup: int,
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
