"""Accelerator plugins (see base.Accelerator for the contract)."""

from loongforge.core.accelerators.base import Accelerator, MemoryStats
from loongforge.core.accelerators.registry import (
    ENV_VAR,
    AcceleratorError,
    get_accelerator,
    installed_accelerators,
    load_accelerator,
)

__all__ = [
    "Accelerator",
    "AcceleratorError",
    "ENV_VAR",
    "MemoryStats",
    "get_accelerator",
    "installed_accelerators",
    "load_accelerator",
]
