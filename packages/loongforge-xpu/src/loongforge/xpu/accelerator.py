"""The ``xpu`` accelerator: LoongForge's device and collective needs mapped onto Kunlunxin's runtime.

Registered under the ``loongforge.accelerators`` entry-point group as ``xpu`` and selected with
``LOONGFORGE_ACCELERATOR=xpu``. Loading the entry point imports only this module; the vendor
runtime (``torch_xmlir``) is imported when the accelerator is instantiated, and a missing runtime
is a :class:`~loongforge.xpu.runtime.KunlunRuntimeMissing` error naming the module and how to
install it.
"""

from __future__ import annotations

import torch

from loongforge.core.accelerators import Accelerator, MemoryStats
from loongforge.xpu.runtime import KunlunRuntime, load_runtime


class XpuAccelerator(Accelerator):
    name = "xpu"

    def __init__(self, runtime: KunlunRuntime | None = None):
        self.runtime = load_runtime() if runtime is None else runtime
        self.device_type = self.runtime.device_type
        self.dist_backend = self.runtime.dist_backend

    @property
    def _dev(self):
        return self.runtime.device_module

    def is_available(self) -> bool:
        return bool(self._dev.is_available()) and self.device_count() > 0

    def device_count(self) -> int:
        return int(self._dev.device_count())

    def set_device(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != self.device_type:
            raise ValueError(f"the xpu accelerator computes on {self.device_type!r} devices, not on {device}")
        self._dev.set_device(device)

    def manual_seed(self, seed: int) -> None:
        # Seeds the host generator and every device generator torch has, torch.cuda's included (on
        # xpytorch builds those are the Kunlun generators).
        torch.manual_seed(seed)

    def synchronize(self) -> None:
        self._dev.synchronize()

    def memory_stats(self) -> MemoryStats:
        dev = self._dev
        if not hasattr(dev, "memory_allocated"):
            # A device module without allocator statistics (torch.cpu): the contract reports 0.
            return MemoryStats(allocated=0, peak_allocated=0, reserved=0, total=0)
        return MemoryStats(
            allocated=int(dev.memory_allocated()),
            peak_allocated=int(dev.max_memory_allocated()),
            reserved=int(dev.memory_reserved()),
            total=int(dev.get_device_properties(dev.current_device()).total_memory),
        )

    def reset_peak_memory_stats(self) -> None:
        if hasattr(self._dev, "reset_peak_memory_stats"):
            self._dev.reset_peak_memory_stats()

    def install_megatron_adaptations(self) -> list[str]:
        from loongforge.xpu import megatron_adaptations

        return megatron_adaptations.install(self.runtime)

    def supports_triton(self) -> bool:
        return self.runtime.triton

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        return None  # no public dense peak figure for Kunlun parts that MFU could rely on
