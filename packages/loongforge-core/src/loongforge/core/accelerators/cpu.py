"""The built-in CPU accelerator (gloo). It makes megatron-core run without a GPU, so every
parallel layout can be tested in CI; the adaptations live in ``cpu_megatron``."""

from __future__ import annotations

import os

import psutil
import torch

from loongforge.core.accelerators.base import Accelerator, MemoryStats


class CpuAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the cpu accelerator cannot compute on {device}")

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def synchronize(self) -> None:
        return None

    def memory_stats(self) -> MemoryStats:
        rss = psutil.Process(os.getpid()).memory_info().rss
        return MemoryStats(allocated=rss, peak_allocated=rss, reserved=rss, total=psutil.virtual_memory().total)

    def reset_peak_memory_stats(self) -> None:
        return None

    def install_megatron_adaptations(self) -> list[str]:
        from loongforge.core.accelerators import cpu_megatron

        return cpu_megatron.install()
