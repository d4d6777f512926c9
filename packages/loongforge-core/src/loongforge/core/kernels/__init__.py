"""The kernel registry: named ops defined by the packages that own them (each a torch reference,
a ``loongforge.ops`` entry point), fused implementations from kernel wheels (see registry.py), and
``KernelPolicy``, the choice a builder hands the modules it makes (policy.py)."""

from loongforge.core.kernels.policy import KernelPolicy
from loongforge.core.kernels.registry import (
    KernelImpl, KernelRegistryError, OpContract, OpWithBackward, get_kernel, get_kernel_with_backward, get_op,
    installed_kernels, installed_ops,
)

__all__ = [
    "KernelImpl", "KernelPolicy", "KernelRegistryError", "OpContract", "OpWithBackward", "get_kernel",
    "get_kernel_with_backward", "get_op", "installed_kernels", "installed_ops",
]
