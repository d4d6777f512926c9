"""LoongForge accelerator plugin for Kunlunxin (Kunlun) XPUs.

Selected with ``LOONGFORGE_ACCELERATOR=xpu`` through the ``loongforge.accelerators`` entry point;
nothing imports this package directly. Importing it does not import Kunlunxin's runtime
(``torch_xmlir``): :class:`XpuAccelerator` does, when it is instantiated.
"""

from loongforge.xpu.accelerator import XpuAccelerator
from loongforge.xpu.runtime import KunlunRuntime, KunlunRuntimeMissing, load_runtime

__all__ = ["KunlunRuntime", "KunlunRuntimeMissing", "XpuAccelerator", "load_runtime"]
