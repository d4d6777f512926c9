"""``lf-* compare RUN_A RUN_B``: how far one run's loss curve is from another's.

The curves are compared window by window (the mean over ``window`` consecutive logged steps that
both runs have; a shorter tail joins the last window), as the relative difference ``b / a - 1`` with run A the reference: per-step losses are too
noisy to compare one by one, and a window mean is what a plotted curve shows. ``--tolerance``
turns the comparison into a check (exit status 1 when a window from ``--from-step`` on differs by
more), e.g. an FP8 run against its bf16 twin, or a new release against a recorded run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from loongforge.core.metrics import read_metrics


@dataclass(frozen=True)
class Window:
    first_step: int
    last_step: int
    mean_a: float
    mean_b: float

    @property
    def relative(self) -> float:
        """``b / a - 1``; NaN when either mean is (a run that diverged), inf when only A's is 0."""
        if self.mean_a == 0:
            return 0.0 if self.mean_b == 0 else math.inf
        return self.mean_b / self.mean_a - 1.0

    @property
    def diverged(self) -> bool:
        """Either run's mean is NaN or inf: its loss in this window is not a finite number."""
        return not (math.isfinite(self.mean_a) and math.isfinite(self.mean_b))

    @property
    def distance(self) -> float:
        """|relative|, with a diverged window as far as it gets."""
        return math.inf if self.diverged else abs(self.relative)

    def difference(self, name_a: str, name_b: str) -> str:
        """``relative`` as a signed percentage, or which run diverged, e.g. ``diverged (B: nan)``."""
        if not self.diverged:
            return f"{self.relative:+.2%}"
        runs = [f"{name}: {mean}" for name, mean in ((name_a, self.mean_a), (name_b, self.mean_b)) if not math.isfinite(mean)]
        return f"diverged ({', '.join(runs)})"


@dataclass(frozen=True)
class CurveComparison:
    key: str
    windows: list[Window]

    def worst(self, from_step: int = 1) -> Window:
        """The window (of those starting at or after ``from_step``) with the largest |difference|;
        a diverged window counts as the largest."""
        candidates = [w for w in self.windows if w.first_step >= from_step]
        if not candidates:
            raise ValueError(f"no comparison window starts at or after step {from_step} "
                             f"(last window starts at step {self.windows[-1].first_step})")
        return max(candidates, key=lambda w: w.distance)


def _curve(run_dir: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of ``key`` in the run's metrics; a value that is not a number is a
    ValueError naming the file and step."""
    curve = {}
    for record in read_metrics(run_dir):
        if key in record:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{run_dir / 'metrics.jsonl'}: step {record['step']}: {key}={value!r} is not a number")
            curve[record["step"]] = float(value)
    if not curve:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no record has the key {key!r}")
    return curve


def compare_runs(run_a: str | Path, run_b: str | Path, key: str = "loss", window: int = 10) -> CurveComparison:
    """Window means of ``key`` over the steps both runs logged (in step order), A vs B; windows
    count logged records, so with ``log.interval=5`` a window of 10 spans 50 steps."""
    if window < 1:
        raise ValueError(f"window={window}: must be >= 1")
    a, b = _curve(Path(run_a), key), _curve(Path(run_b), key)
    steps = sorted(a.keys() & b.keys())
    if not steps:
        raise ValueError(f"{run_a} and {run_b} logged {key!r} at no common step")
    chunks = [steps[i : i + window] for i in range(0, len(steps), window)]
    if len(chunks) > 1 and len(chunks[-1]) < window:  # a short tail joins the window before it
        chunks[-2:] = [chunks[-2] + chunks[-1]]
    windows = [Window(c[0], c[-1], sum(a[s] for s in c) / len(c), sum(b[s] for s in c) / len(c)) for c in chunks]
    return CurveComparison(key, windows)


def format_comparison(result: CurveComparison, name_a: str, name_b: str, worst: Window, from_step: int = 1) -> str:
    """The window table and a last line on ``worst`` (``result.worst(from_step)``)."""
    width = max(len(name_a), len(name_b), 8)
    lines = [f"{'steps':>11}  {name_a:>{width}}  {name_b:>{width}}  {'b/a - 1':>8}"]
    for w in result.windows:
        lines.append(f"{w.first_step:>5}-{w.last_step:<5}  {w.mean_a:>{width}.4f}  {w.mean_b:>{width}.4f}  {w.difference(name_a, name_b):>8}")
    largest = worst.difference(name_a, name_b) if worst.diverged else f"{worst.distance:.2%}"
    lines.append(f"largest |difference| of the {result.key} window means from step {from_step}: "
                 f"{largest} (steps {worst.first_step}-{worst.last_step})")
    return "\n".join(lines)
