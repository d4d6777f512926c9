"""Every adaptation megatron-core (0.19.x) needs on Kunlunxin's runtime, in one place.

Which ones depend on the torch device type the runtime serves the XPU under:

* ``"cuda"`` (xpytorch builds): megatron's own ``torch.cuda`` calls already reach the Kunlun
  device -- current device, ``device="cuda"`` allocations, streams and events, synchronize, the
  CUDA RNG states its tracker forks (``torch.cuda.Stream``/``Event`` and the caching allocator are
  torch's own code over Kunlunxin's CUDA-ABI layer). None of cpu_megatron's routing is needed;
  what differs is listed in ``CUDA_SERVED`` below, each entry saying why.
* ``"cpu"`` (a runtime whose device is the host, as the test stand-in is): megatron needs
  exactly what it needs on the host, which the core's cpu adaptations own; they are installed
  from there rather than repeated here.
* anything else: megatron-core hard-codes ``torch.cuda``, and routing it to another device module
  is not something this plugin knows how to do, so installing is an error naming the type.

``install()`` is idempotent; it is called by the accelerator before any model is built.
"""

from __future__ import annotations

from collections.abc import Callable

from loongforge.core.accelerators import AcceleratorError
from loongforge.xpu.runtime import DEVICE_TYPE_ENV, KunlunRuntime

_installed: list[str] = []


def compile_eagerly() -> None:
    """megatron wraps its bias/activation fusions in ``torch.compile`` (``megatron.core.jit.
    jit_fuser`` on torch >= 2.2), applied when its modules are imported. Inductor lowers them to
    upstream Triton kernels, which fail to launch on Kunlun's P800 (Kunlunxin's vLLM plugin swaps
    every upstream Triton kernel it meets for a torch path), and vLLM-Kunlun forces the eager
    compile backend for the same reason. Dynamo's ``disable`` switch is read at call time, so the
    fusions already wrapped by an earlier import also run as plain eager torch."""
    import torch._dynamo

    torch._dynamo.config.disable = True


CUDA_SERVED: dict[str, Callable[[], None]] = {
    "compile_eagerly": compile_eagerly,
}


def install(runtime: KunlunRuntime) -> list[str]:
    """Install every adaptation ``runtime`` needs that is not installed yet; returns all installed."""
    if runtime.device_type == "cuda":
        for name, adapt in CUDA_SERVED.items():
            if name not in _installed:
                adapt()
                _installed.append(name)
        return list(_installed)
    if runtime.device_type == "cpu":
        # The runtime computes on the host: megatron needs the core's cpu adaptations, no more.
        from loongforge.core.accelerators import cpu_megatron

        return cpu_megatron.install()
    raise AcceleratorError(
        f"{DEVICE_TYPE_ENV}={runtime.device_type!r}: megatron-core calls torch.cuda directly and the xpu "
        f"plugin can adapt it only to a runtime that serves its device as 'cuda' (xpytorch builds) or as the "
        f"host 'cpu'; torch.{runtime.device_type} is neither"
    )
