"""The binding to Kunlunxin's PyTorch runtime: every name this plugin takes from it, in one place.

Kunlunxin's runtime for PyTorch is the ``torch_xmlir`` module that the "xpytorch" installer puts
next to a Kunlunxin build of torch. Importing it activates the Kunlun device, which it does not
register as a device type of its own: it serves it through torch's CUDA device module, so
tensors report ``device.type == "cuda"``, ``torch.cuda.*`` drives the XPU, and collectives run
through the ``"nccl"`` backend name. The package README lists the public sources for each of
these facts.

So the runtime this plugin binds is three things: the imported vendor module, the torch device
type and collective backend it serves, and the torch device module of that type (``torch.cuda``
on xpytorch builds), which every device call goes through. Nothing here imports ``torch_xmlir``
until :func:`load_runtime` is called.

A runtime build that serves the device under other names can be described with
``LOONGFORGE_XPU_DEVICE_TYPE`` and ``LOONGFORGE_XPU_DIST_BACKEND``; ``LOONGFORGE_XPU_TRITON=1``
declares that the build runs LoongForge's Triton kernels (off by default: upstream Triton kernels
do not run on Kunlun's P800).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from loongforge.core.accelerators import ENV_VAR, AcceleratorError

RUNTIME_MODULE = "torch_xmlir"
DEVICE_TYPE_ENV = "LOONGFORGE_XPU_DEVICE_TYPE"
DIST_BACKEND_ENV = "LOONGFORGE_XPU_DIST_BACKEND"
TRITON_ENV = "LOONGFORGE_XPU_TRITON"

# How xpytorch builds of torch_xmlir present the Kunlun device to PyTorch.
XPYTORCH_DEVICE_TYPE = "cuda"
XPYTORCH_DIST_BACKEND = "nccl"

INSTALL_HINT = (
    "Install Kunlunxin's PyTorch runtime for your torch and Python version: the xpytorch installer "
    "from the Kunlunxin SDK (xpytorch-cp<python>-torch<version>-ubuntu<release>-x64.run, run with bash), "
    f"which provides the '{RUNTIME_MODULE}' module, then check it with `python -m {RUNTIME_MODULE} --doctor`. "
    "It is not on PyPI, so pip/uv cannot install it."
)


class KunlunRuntimeMissing(AcceleratorError):
    """The Kunlunxin runtime module cannot be imported in this environment."""


@dataclass(frozen=True)
class KunlunRuntime:
    """One imported Kunlunxin runtime and the torch names it serves the device under."""

    vendor: ModuleType  # the imported torch_xmlir
    device_type: str  # torch device type of the runtime's tensors ("cuda" on xpytorch)
    dist_backend: str  # torch.distributed backend of its collectives ("nccl" on xpytorch)
    device_module: ModuleType  # torch.<device_type>: device count, selection, sync, allocator
    triton: bool  # whether the build runs LoongForge's Triton kernels


def _import_vendor() -> ModuleType:
    try:
        return importlib.import_module(RUNTIME_MODULE)
    except ImportError as exc:
        raise KunlunRuntimeMissing(
            f"{ENV_VAR}='xpu' needs Kunlunxin's PyTorch runtime, but the Python module "
            f"'{RUNTIME_MODULE}' cannot be imported ({exc}). {INSTALL_HINT}"
        ) from exc
    except Exception as exc:  # found, but its own initialisation failed (driver, device files)
        raise AcceleratorError(
            f"{ENV_VAR}='xpu': the Kunlunxin runtime module '{RUNTIME_MODULE}' was found but failed to "
            f"initialise: {type(exc).__name__}: {exc}. Check the driver and /dev/xpu* with "
            f"`python -m {RUNTIME_MODULE} --doctor`."
        ) from exc


def _device_type(environ: Mapping[str, str]) -> tuple[str, ModuleType]:
    value = environ.get(DEVICE_TYPE_ENV, "").strip() or XPYTORCH_DEVICE_TYPE
    try:
        device_type = torch.device(value).type
    except RuntimeError as exc:
        raise AcceleratorError(f"{DEVICE_TYPE_ENV}={value!r} is not a torch device type: {exc}") from exc
    if device_type != value:
        raise AcceleratorError(f"{DEVICE_TYPE_ENV}={value!r}: give a bare device type such as {device_type!r}")
    try:
        module = torch.get_device_module(device_type)
    except RuntimeError as exc:
        raise AcceleratorError(f"{DEVICE_TYPE_ENV}={value!r}: torch has no device module for it ({exc})") from exc
    return device_type, module


def _dist_backend(environ: Mapping[str, str]) -> str:
    value = environ.get(DIST_BACKEND_ENV, "").strip()
    if not value:
        return XPYTORCH_DIST_BACKEND
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if value not in known:
        raise AcceleratorError(f"{DIST_BACKEND_ENV}={value!r} is not a torch.distributed backend (known: {', '.join(known)})")
    return value


def _triton(environ: Mapping[str, str]) -> bool:
    value = environ.get(TRITON_ENV, "0").strip()
    if value not in ("0", "1"):
        raise AcceleratorError(f"{TRITON_ENV}={value!r}: must be 0 or 1")
    return value == "1"


def load_runtime(environ: Mapping[str, str] | None = None) -> KunlunRuntime:
    """Import the Kunlunxin runtime and resolve the torch names it serves the device under.

    Raises :class:`KunlunRuntimeMissing` (an ``AcceleratorError``) naming the module and how to
    install it when ``torch_xmlir`` cannot be imported, and ``AcceleratorError`` naming the
    variable for a bad ``LOONGFORGE_XPU_*`` value. Nothing falls back to another device.
    """
    environ = os.environ if environ is None else environ
    device_type, device_module = _device_type(environ)  # validate settings before touching the runtime
    dist_backend = _dist_backend(environ)
    triton = _triton(environ)
    vendor = _import_vendor()
    return KunlunRuntime(vendor=vendor, device_type=device_type, dist_backend=dist_backend,
                         device_module=device_module, triton=triton)
