"""What the ``lf-* bench`` commands share: timing a step on the accelerator, its peak memory, a
measured matmul peak for MFU, and torch.profiler tables of the hottest kernels and ops."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from loongforge.core.accelerators import get_accelerator


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
        self.accel.synchronize()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            self.accel.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

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


def profile_tables(step: Callable[[], object], device: BenchDevice, rows: int, trace: str | None = None) -> str:
    """Two profiled calls of ``step``: the top GPU kernels and the top torch ops by the GPU time of
    the kernels they launched (on CPU: the top torch ops by their own CPU time); ``trace``: also
    write a Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        device.accel.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.key_averages()
    ops = [e for e in events if e.device_type.name == "CPU" and e.key.startswith("aten::")]
    if not device.cuda:
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
