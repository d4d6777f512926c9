"""The built-in CUDA accelerator (NCCL). megatron-core targets CUDA, so it needs no adaptation."""

from __future__ import annotations

import torch

from loongforge.core.accelerators.base import Accelerator, MemoryStats
from loongforge.core.device_peaks import spec_peak_bf16


class CudaAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_stats(self) -> MemoryStats:
        free, total = torch.cuda.mem_get_info()
        return MemoryStats(
            allocated=torch.cuda.memory_allocated(),
            peak_allocated=torch.cuda.max_memory_allocated(),
            reserved=torch.cuda.memory_reserved(),
            total=total,
        )

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def supports_triton(self) -> bool:
        return torch.cuda.is_available()

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        flops = spec_peak_bf16(torch.cuda.get_device_name())
        if flops is None:
            return None
        return flops / 2 if dtype == torch.float32 else flops  # fp32 runs as TF32
