"""What ``lf-* env`` reports: package versions, the GPUs found, the accelerator a run would use and
the kernel providers installed. It imports no torch (nor any plugin or provider module), so it
answers at once: versions come from the installed distributions' metadata, GPUs from
``nvidia-smi`` where it exists, plugins and providers from their entry points."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, distribution, entry_points, version

from loongforge.core.accelerators.registry import ENTRY_POINT_GROUP as ACCELERATORS_GROUP
from loongforge.core.accelerators.registry import ENV_VAR as ACCELERATOR_ENV_VAR
from loongforge.core.kernels.registry import ENTRY_POINT_GROUP as PROVIDERS_GROUP
from loongforge.core.kernels.registry import OPS_GROUP

NVIDIA_SMI_TIMEOUT_S = 1.5


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def torch_cuda_build() -> str | None:
    """The CUDA version the installed torch was built for (``torch.version.cuda``), read from its
    ``version.py`` without importing torch; None for a CPU build or where torch is not installed."""
    try:
        source = distribution("torch").locate_file("torch/version.py").read_text()
    except (PackageNotFoundError, OSError):
        return None
    for node in ast.parse(source).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(target, ast.Name) and target.id == "cuda":
            value = node.value
            return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
    return None


def nvidia_gpus(timeout: float = NVIDIA_SMI_TIMEOUT_S) -> tuple[list[str], str]:
    """``(["NAME, MEMORY", ...], why_none)``: the NVIDIA GPUs ``nvidia-smi`` lists, else no GPUs and
    the reason (no nvidia-smi, it failed, or it did not answer within ``timeout`` seconds)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "none found (no nvidia-smi on PATH)"
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [], f"unknown (nvidia-smi did not answer within {timeout:g} s)"
    except OSError as exc:
        return [], f"unknown (nvidia-smi: {exc})"
    if out.returncode != 0:
        return [], f"none found (nvidia-smi: {(out.stderr or out.stdout).strip().splitlines()[:1] or out.returncode})"
    return [line.strip() for line in out.stdout.splitlines() if line.strip()], "none found"


def _providers(group: str) -> list[str]:
    """``NAME (DISTRIBUTION VERSION)`` for each entry point of ``group``, none of them loaded."""
    found = []
    for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
        dist = getattr(ep, "dist", None)
        found.append(f"{ep.name} ({dist.name} {dist.version})" if dist is not None else ep.name)
    return found


def describe_environment(packages: Iterable[str]) -> list[tuple[str, str]]:
    """``(what, value)`` lines: each package's version, torch's CUDA build, the NVIDIA GPUs found,
    every installed accelerator plugin, the one a run would use (``$LOONGFORGE_ACCELERATOR``, or
    auto: cuda where torch has a CUDA build and a GPU is found, else cpu), the kernel providers and
    the ops defined. Which ops run a fused kernel is decided when a run looks them up on its device."""
    lines = [(name, package_version(name)) for name in dict.fromkeys(packages)]
    cuda = torch_cuda_build()
    lines.append(("torch CUDA build", cuda or "none"))
    gpus, why_none = nvidia_gpus()
    lines.append(("NVIDIA GPUs", f"{len(gpus)}: {'; '.join(gpus)}" if gpus else why_none))
    plugins = _providers(ACCELERATORS_GROUP)
    lines.append(("accelerator plugins", ", ".join(plugins) or "none"))
    requested = (os.environ.get(ACCELERATOR_ENV_VAR) or "auto").strip().lower()
    if requested != "auto":
        installed = {p.split()[0] for p in plugins}
        note = "" if requested in installed else " (not installed: a run stops with an error)"
        lines.append(("accelerator in use", f"{requested} (set by {ACCELERATOR_ENV_VAR}){note}"))
    elif cuda and gpus:
        lines.append(("accelerator in use", f"cuda ({ACCELERATOR_ENV_VAR} unset or auto; torch has CUDA {cuda} and a GPU is found)"))
    else:
        why = "no GPU found" if cuda else "torch has no CUDA build"
        lines.append(("accelerator in use", f"cpu ({ACCELERATOR_ENV_VAR} unset or auto; {why})"))
    lines.append(("kernel providers", ", ".join(_providers(PROVIDERS_GROUP))
                  or "none (the loongforge-kernels wheel is not installed: every op runs its torch reference)"))
    lines.append(("ops defined", ", ".join(sorted({ep.name for ep in entry_points(group=OPS_GROUP)})) or "none"))
    return lines
