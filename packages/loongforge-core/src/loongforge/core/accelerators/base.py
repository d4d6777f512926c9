"""The accelerator contract: what LoongForge needs from a device runtime.

An accelerator plugin is a class registered under the ``loongforge.accelerators`` entry-point
group. It names its torch device type and collective backend, seeds RNG, reports memory, and
installs whatever adaptations megatron-core needs on that device. Everything device-specific in
LoongForge goes through one of these objects; modality packages never branch on the vendor.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is made, so `lf-X env` can list plugins without it
    import torch


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device in bytes (0 where the runtime cannot tell)."""

    allocated: int
    peak_allocated: int
    reserved: int
    total: int


class Accelerator(ABC):
    """One device runtime. Subclasses set the three class attributes and the abstract methods."""

    name: str = ""  # the LOONGFORGE_ACCELERATOR value that selects it
    device_type: str = ""  # torch device type, e.g. "cuda", "cpu", "xpu"
    dist_backend: str = ""  # torch.distributed backend, e.g. "nccl", "gloo"

    @abstractmethod
    def is_available(self) -> bool:
        """Whether this runtime can run here (driver and device present)."""

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this type visible to the process."""

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def device(self, local_rank: int | None = None) -> torch.device:
        """The torch device a process with this local rank computes on."""
        import torch

        rank = self.local_rank() if local_rank is None else local_rank
        return torch.device(self.device_type, rank % max(self.device_count(), 1))

    @abstractmethod
    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the current device of the process."""

    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the host and device RNGs."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued device work."""

    @abstractmethod
    def memory_stats(self) -> MemoryStats:
        """Memory of the current device."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Start a new peak-memory measurement."""

    def install_megatron_adaptations(self) -> list[str]:
        """Adapt megatron-core to this runtime; returns the names of adaptations installed.

        Must be idempotent. The default installs nothing (megatron-core targets CUDA natively).
        """
        return []

    def supports_triton(self) -> bool:
        """Whether Triton kernels can run on this device (used by the kernel registry)."""
        return False

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense peak FLOP/s of one device for ``dtype``, for MFU; None when unknown."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_type={self.device_type!r}, backend={self.dist_backend!r})"
