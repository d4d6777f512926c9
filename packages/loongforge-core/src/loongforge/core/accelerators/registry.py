"""Accelerator selection through the ``loongforge.accelerators`` entry-point group.

``LOONGFORGE_ACCELERATOR`` picks one: ``auto`` (default: cuda when present, else cpu), or the
name of any installed plugin (``cuda``, ``cpu``, ``xpu`` ...). Asking for one that is not
installed, or whose runtime cannot be imported, is an error; nothing falls back silently.
"""

from __future__ import annotations

import os
from functools import cache
from importlib.metadata import EntryPoint, entry_points

from loongforge.core.accelerators.base import Accelerator
from loongforge.core.errors import UserError

ENTRY_POINT_GROUP = "loongforge.accelerators"
ENV_VAR = "LOONGFORGE_ACCELERATOR"


class AcceleratorError(UserError, RuntimeError):
    """An accelerator was asked for that cannot be used here."""


def installed_accelerators() -> dict[str, EntryPoint]:
    """Entry points of every installed accelerator plugin, by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_accelerator(name: str) -> Accelerator:
    """Instantiate the plugin registered as ``name`` (no availability check)."""
    plugins = installed_accelerators()
    if name not in plugins:
        raise AcceleratorError(
            f"{ENV_VAR}={name!r}: no accelerator plugin named {name!r} is installed "
            f"(installed: {', '.join(sorted(plugins)) or 'none'}). "
            + (f"Install it with `pip install loongforge-{name}`." if name not in ("cpu", "cuda") else "")
        )
    ep = plugins[name]
    try:
        cls = ep.load()
    except ImportError as exc:  # the plugin's own runtime is missing
        raise AcceleratorError(f"accelerator plugin {name!r} ({ep.value}) cannot be imported: {exc}") from exc
    accel = cls()
    if not isinstance(accel, Accelerator):
        raise AcceleratorError(f"accelerator plugin {name!r} ({ep.value}) is not a loongforge Accelerator")
    return accel


@cache
def _select(requested: str) -> Accelerator:
    if requested == "auto":
        cuda = load_accelerator("cuda")
        return cuda if cuda.is_available() else load_accelerator("cpu")
    accel = load_accelerator(requested)
    if not accel.is_available():
        raise AcceleratorError(
            f"{ENV_VAR}={requested!r}: the {requested} runtime is installed but no device is available"
        )
    return accel


def get_accelerator(name: str | None = None) -> Accelerator:
    """The accelerator this process uses: ``name``, else ``$LOONGFORGE_ACCELERATOR``, else auto."""
    requested = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    return _select(requested)
