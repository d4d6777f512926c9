"""What the ``lf-* bench`` commands share: timing a step on the accelerator, its peak memory, a
measured matmul peak for MFU, torch.profiler tables of the hottest kernels and ops, the
``--variant NAME=KEY=VALUE,...`` syntax and the final table of the runs against the baselines."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from loongforge.core.accelerators import get_accelerator
from loongforge.core.config import ConfigError

CLOSERS = {"[": "]", "{": "}", "(": ")"}  # the brackets a variant item's value may hold commas in


def timed_calls(step: Callable[[], object], steps: int, synchronize: Callable[[], None]) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step`` (host clock, the device synchronised before
    the first and after each)."""
    synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - t0)
    return times


class BenchDevice:
    """The accelerator a bench runs on: bf16 on GPUs, fp32 on CPU (a smoke run of the same code)."""

    def __init__(self):
        self.accel = get_accelerator()
        self.device = self.accel.device()
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16

    def describe(self) -> str:
        name = torch.cuda.get_device_name() if self.cuda else self.device.type
        return f"{name}; torch {torch.__version__}; {self.dtype}"

    def timed(self, step: Callable[[], object], steps: int, warmup: int) -> float:
        """Median seconds of ``steps`` calls after ``warmup`` calls (synchronised host clock)."""
        for _ in range(warmup):
            step()
        return statistics.median(timed_calls(step, steps, self.accel.synchronize))

    def fresh_memory(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        if self.device.type != "cpu":
            self.accel.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        """Peak allocated memory since ``fresh_memory``, from the accelerator (NaN on the CPU,
        where it is not tracked)."""
        return self.accel.memory_stats().peak_allocated / 2**30 if self.device.type != "cpu" else float("nan")

    def matmul_peak(self) -> float:
        """Measured FLOP/s of a square matrix product in the bench dtype: what MFU is taken against."""
        n = 8192 if self.cuda else 1024
        a = torch.randn(n, n, device=self.device, dtype=self.dtype)
        b = torch.randn_like(a)
        seconds = self.timed(lambda: a @ b, steps=20, warmup=3)
        return 2 * n**3 / seconds


def counted_flops(step: Callable[[], object]) -> float:
    """The floating-point operations torch's ``FlopCounterMode`` counts in one call of ``step``
    (matrix products, convolutions and attention, forward and backward): the model FLOPs of an
    uncompiled step without recomputation (compiled code runs below the dispatcher it counts in,
    and recomputed forwards would count twice)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(counter.get_total_flops())


def profile_tables(step: Callable[[], object], rows: int, trace: str | None = None) -> str:
    """Two profiled calls of ``step`` on the accelerator: the top GPU kernels and the top torch ops
    by the GPU time of the kernels they launched (on CPU: the top torch ops by their own CPU time);
    ``trace``: also write a Chrome trace there. What ``lf-X bench --profile-rows N`` prints."""
    from torch.profiler import ProfilerActivity, profile

    accel = get_accelerator()
    cuda = accel.device().type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        accel.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.key_averages()
    ops = [e for e in events if e.device_type.name == "CPU" and e.key.startswith("aten::")]
    if not cuda:
        lines = ["top torch ops by their own CPU time, ms per step:"]
        for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:rows]:
            lines.append(f"{e.self_cpu_time_total / 2e3:8.2f} {e.count // 2:5d}x  {e.key}")
        return "\n".join(lines)
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels) / 2 / 1e3
    lines = [f"GPU kernel time per step: {total:.1f} ms (2 steps profiled); top kernels, ms per step:"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        lines.append(f"{e.self_device_time_total / 2e3:8.2f} {e.count // 2:5d}x  {e.key[:110]}")
    lines.append("top torch ops by the GPU time of their kernels, ms per step:")
    for e in sorted((e for e in ops if e.device_time_total), key=lambda e: -e.device_time_total)[:rows]:
        lines.append(f"{e.device_time_total / 2e3:8.2f} {e.count // 2:5d}x  {e.key}")
    return "\n".join(lines)


def check_timing(steps: int, warmup: int) -> None:
    """``--steps`` and ``--warmup`` of a bench: at least one timed step, no negative warm-up."""
    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps {steps} --warmup {warmup}: at least one timed step, no negative warm-up")


# -- --variant NAME=KEY=VALUE,... ---------------------------------------------------------------
def split_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets, braces, parentheses and quotes, so that a
    list or a quoted string stays one item (``a=[1,2],b="x,y"`` -> ``a=[1,2]``, ``b="x,y"``);
    "" gives no item. ValueError where a bracket or a quote is left open, or a closing bracket
    matches no open one."""
    if not text:
        return []
    items, start, quote = [], 0, None
    open_brackets = []  # the closing brackets due, innermost last
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in CLOSERS:
            open_brackets.append(CLOSERS[ch])
        elif ch in CLOSERS.values():
            if not open_brackets or open_brackets.pop() != ch:
                raise ValueError(f"{ch!r} closes no open bracket")
        elif ch == "," and not open_brackets:
            items.append(text[start:i])
            start = i + 1
    if quote or open_brackets:
        raise ValueError(f"{quote or open_brackets[-1]!r} is missing at the end")
    return [*items, text[start:]]


def parse_variant(spec: str, taken_names: Collection[str], reserved_prefix: str = "hf_") -> tuple[str, list[str]]:
    """``--variant NAME=KEY=VALUE,...``: the run's name and its ``key=value`` items (split by
    ``split_items``). The name must be new (not one of ``taken_names``, the runs before it) and
    not start with ``reserved_prefix`` (the baselines' names); every item is ``key=value``."""
    name, _, rest = spec.partition("=")
    form = "NAME=KEY=VALUE,..."
    if not name:
        raise ConfigError(f"--variant {spec!r}: give it a name of its own ({form})")
    if name.startswith(reserved_prefix):
        raise ConfigError(f"--variant {spec!r}: give it a name of its own, not starting with {reserved_prefix} "
                          f"(the baselines' prefix)")
    if name in taken_names:
        raise ConfigError(f"--variant {spec!r}: give it a name of its own ({name!r} names an earlier run)")
    try:
        items = split_items(rest)
    except ValueError as exc:
        raise ConfigError(f"--variant {spec!r}: {exc} ({form})") from None
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--variant {spec!r}: item {item!r} is not of the form key=value")
    return name, items


# -- the final table ----------------------------------------------------------------------------
@dataclass
class RunResult:
    """One run's measurements, as the final table shows them."""

    tokens_per_s: float
    tflops: float  # model TFLOP/s
    mfu: float  # model FLOP/s over the measured matmul peak
    peak_gib: float  # NaN where the accelerator keeps no memory statistics


@dataclass(frozen=True)
class ExtraColumn:
    """A bench's own column of the final table, after peak GiB: its title, each run's value, the
    column width and the value's format spec."""

    title: str
    values: Mapping[str, float]
    width: int = 9
    spec: str = ".4f"


def results_table(results: Mapping[str, RunResult], baseline_prefix: str = "hf_", tokens_decimals: int = 0,
                  extra: Sequence[ExtraColumn] = ()) -> list[str]:
    """The lines of the final table: a header, then one row per run in ``results``' order with its
    tokens/s (``tokens_decimals`` decimals), TFLOP/s, MFU, peak GiB, the ``extra`` columns and one
    ratio column per baseline (the runs named ``baseline_prefix...``): the run's tokens/s over the
    baseline's."""
    baselines = [name for name in results if name.startswith(baseline_prefix)]
    lines = [f"{'run':<22}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak GiB':>10}"
             + "".join(f"{c.title:>{c.width}}" for c in extra) + "".join(f"{'x ' + b:>18}" for b in baselines)]
    for name, r in results.items():
        columns = "".join(f"{c.values[name]:>{c.width}{c.spec}}" for c in extra)
        ratios = "".join(f"{r.tokens_per_s / results[b].tokens_per_s:>18.2f}" for b in baselines)
        lines.append(f"{name:<22}{r.tokens_per_s:>12,.{tokens_decimals}f}{r.tflops:>10.2f}{r.mfu:>8.1%}"
                     f"{r.peak_gib:>10.1f}{columns}{ratios}")
    return lines
