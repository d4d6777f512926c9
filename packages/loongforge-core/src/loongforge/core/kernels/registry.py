"""Named fused ops: a torch reference per op, overridden by installed kernel wheels.

A kernel wheel registers a provider under the ``loongforge.kernels`` entry-point group: a
zero-argument callable returning ``{op_name: KernelImpl}``. ``get_kernel(name)`` returns the
provider's implementation when one is installed and ``supports(accelerator)`` holds, else the
reference. ``LOONGFORGE_KERNELS=reference`` always picks the reference: it is the one switch, which the
``kernels.force_reference`` config key sets through :func:`force_reference_kernels` (and
``get_kernel(name, force_reference=True)`` applies to one lookup).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points

from loongforge.core.kernels.reference import REFERENCE_OPS

ENTRY_POINT_GROUP = "loongforge.kernels"
ENV_VAR = "LOONGFORGE_KERNELS"


@dataclass(frozen=True)
class KernelImpl:
    """A fused implementation of one named op."""

    fn: Callable
    supports: Callable[[object], bool]  # accelerator -> whether this implementation runs on it
    provider: str = ""


@cache
def installed_kernels() -> dict[str, KernelImpl]:
    """Every fused op provided by installed kernel wheels, by op name."""
    found: dict[str, KernelImpl] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        for op, impl in ep.load()().items():
            if op not in REFERENCE_OPS:
                raise ValueError(f"kernel provider {ep.value!r} registers unknown op {op!r}; known: {sorted(REFERENCE_OPS)}")
            if op in found:
                raise ValueError(f"op {op!r} is registered twice ({found[op].provider} and {ep.value})")
            found[op] = KernelImpl(fn=impl.fn, supports=impl.supports, provider=ep.value)
    return found


def force_reference_kernels() -> None:
    """From now on every ``get_kernel`` of this process (and of processes it starts) returns the
    torch reference: sets ``LOONGFORGE_KERNELS=reference``. Modules resolve their ops when they
    are built, so call it before building the model."""
    os.environ[ENV_VAR] = "reference"


def get_kernel(name: str, accelerator=None, force_reference: bool | None = None) -> Callable:
    """The implementation of op ``name`` to use on ``accelerator`` (default: the current one)."""
    if name not in REFERENCE_OPS:
        raise KeyError(f"unknown kernel op {name!r}; known: {sorted(REFERENCE_OPS)}")
    if force_reference is None:
        force_reference = os.environ.get(ENV_VAR, "auto").lower() == "reference"
    if force_reference:
        return REFERENCE_OPS[name]
    impl = installed_kernels().get(name)
    if impl is None:
        return REFERENCE_OPS[name]
    if accelerator is None:
        from loongforge.core.accelerators import get_accelerator

        accelerator = get_accelerator()
    return impl.fn if impl.supports(accelerator) else REFERENCE_OPS[name]


@dataclass(frozen=True)
class OpWithBackward:
    """A registry op and its backward, an op of its own named ``<name>_backward`` (one fused pass
    where autograd of the forward would make several), resolved together for the autograd
    function that calls both."""

    forward: Callable
    backward: Callable


def get_kernel_with_backward(name: str, accelerator=None, force_reference: bool | None = None) -> OpWithBackward:
    """``get_kernel`` of op ``name`` and of ``<name>_backward``."""
    return OpWithBackward(get_kernel(name, accelerator, force_reference),
                          get_kernel(f"{name}_backward", accelerator, force_reference))
