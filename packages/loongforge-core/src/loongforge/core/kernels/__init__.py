"""The kernel registry: named fused ops with torch references (see registry.py)."""

from loongforge.core.kernels.reference import REFERENCE_OPS
from loongforge.core.kernels.registry import KernelImpl, force_reference_kernels, get_kernel, installed_kernels

__all__ = ["REFERENCE_OPS", "KernelImpl", "force_reference_kernels", "get_kernel", "installed_kernels"]
