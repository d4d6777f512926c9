"""``KernelPolicy``: how the modules a builder makes choose their ops' implementations.

A builder hands its policy to every module it makes (the LLM families read it from
``ParallelContext.kernels``), and each module resolves its ops through it when it is built, so
one model's choice never reaches a model built after it in the same process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loongforge.core.kernels.registry import OpWithBackward, get_kernel, get_kernel_with_backward

if TYPE_CHECKING:
    from loongforge.core.accelerators import Accelerator


@dataclass(frozen=True)
class KernelPolicy:
    """``force_reference``: every op's torch reference, even where a fused kernel would run (False
    leaves the choice to the installed kernels and to ``LOONGFORGE_KERNELS``); ``accelerator``: the
    accelerator the ops are chosen for (None: the current one when an op is resolved)."""

    force_reference: bool = False
    accelerator: Accelerator | None = None

    def get(self, name: str) -> Callable:
        """The implementation of op ``name`` under this policy."""
        return get_kernel(name, self.accelerator, self.force_reference or None)

    def get_with_backward(self, name: str) -> OpWithBackward:
        """Op ``name`` and its backward ``<name>_backward`` under this policy."""
        return get_kernel_with_backward(name, self.accelerator, self.force_reference or None)
