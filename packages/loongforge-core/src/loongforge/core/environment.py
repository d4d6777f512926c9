"""What ``lf-* env`` reports: package versions, the accelerators found and the kernels in use."""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def describe_environment(packages: Iterable[str]) -> list[tuple[str, str]]:
    """``(what, value)`` lines: each package's version, torch's CUDA build and devices, every
    installed accelerator plugin (and whether it has a device here), the one a run would use, and
    which ops run a fused kernel on it (the rest run their torch reference)."""
    import torch

    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.accelerators.registry import (
        AcceleratorError,
        installed_accelerators,
        load_accelerator,
    )
    from loongforge.core.kernels.registry import installed_ops, installed_registry

    lines = [(name, package_version(name)) for name in dict.fromkeys(packages)]
    lines.append(("torch CUDA build", torch.version.cuda or "none"))
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(("CUDA devices", f"{len(names)}: {', '.join(names)}"))
    else:
        lines.append(("CUDA devices", "none"))
    found = []
    for name in sorted(installed_accelerators()):
        try:
            found.append(f"{name} ({'available' if load_accelerator(name).is_available() else 'no device'})")
        except AcceleratorError as exc:
            found.append(f"{name} (cannot load: {str(exc).splitlines()[0][:80]})")
    lines.append(("accelerator plugins", ", ".join(found) or "none"))
    try:
        accelerator = get_accelerator()
        lines.append(("accelerator in use", accelerator.name))
    except AcceleratorError as exc:
        lines.append(("accelerator in use", f"none: {exc}"))
        return lines
    registry = installed_registry()
    fused = sorted(name for name in installed_ops() if registry.resolve(name, accelerator) is not registry.contract(name).reference)
    reference = sorted(set(installed_ops()) - set(fused))
    lines.append(("fused kernels", ", ".join(fused) or "none (the loongforge-kernels wheel is not installed, or "
                                                      "its kernels do not run here)"))
    lines.append(("torch reference ops", ", ".join(reference) or "none"))
    return lines
