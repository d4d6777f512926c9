"""The kernel registry: named fused ops with torch references (see registry.py)."""

from loongforge.core.kernels.reference import REFERENCE_OPS
from loongforge.core.kernels.registry import (
    KernelImpl, OpWithBackward, force_reference_kernels, get_kernel, get_kernel_with_backward, installed_kernels,
)

__all__ = [
    "REFERENCE_OPS", "KernelImpl", "OpWithBackward", "force_reference_kernels", "get_kernel", "get_kernel_with_backward",
    "installed_kernels",
]
