"""A recording stand-in for Kunlunxin's ``torch_xmlir``, used only by the loongforge-xpu tests.

Put on ``sys.path`` (``PYTHONPATH``) of a test subprocess, it is what ``import torch_xmlir`` finds.
The real module, once imported, serves the Kunlun device through torch's CUDA device module.
This stand-in plays that part with no Kunlun device; ``STANDIN_XMLIR_SERVES`` says how:

* ``cuda``: like the real runtime, which replaces ``torch.cuda`` symbols with its own, it replaces
  the ``torch.cuda`` calls a runtime serves (availability, device count and selection,
  synchronize, seeding, allocator statistics, device properties) with recorders over a fake
  host with two devices. This checks every call the plugin makes on the device module. No tensor
  can be put on the fake device.
* ``cpu``: it leaves torch alone. Its device is the host (``torch.cpu``) and its collectives run on
  gloo, which the plugin is told through ``LOONGFORGE_XPU_DEVICE_TYPE=cpu`` and
  ``LOONGFORGE_XPU_DIST_BACKEND=gloo``. This lets real training run through the plugin.

Every call is appended to ``CALLS`` and, when ``STANDIN_XMLIR_RECORD`` names a file, written to
that file as one JSON line per call (the import is the first record).
"""

import json
import os
import types

import torch

__version__ = "0.0-standin"

SERVES = os.environ.get("STANDIN_XMLIR_SERVES", "cuda")
DEVICE_COUNT = 2
ALLOCATED, PEAK, RESERVED = 1_000, 5_000, 8_192
TOTAL = 96 * 2**30  # plus the device index, so a test can see which device was asked about
CALLS: list[list] = []
_state = {"current": 0}


def _arg(value):
    if isinstance(value, torch.device):
        return str(value)
    return value


def record(name, *args):
    entry = [name, *[_arg(a) for a in args]]
    CALLS.append(entry)
    path = os.environ.get("STANDIN_XMLIR_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _serve_cuda() -> None:
    cuda = torch.cuda

    def is_available():
        record("is_available")
        return True

    def device_count():
        record("device_count")
        return DEVICE_COUNT

    def current_device():
        record("current_device")
        return _state["current"]

    def set_device(device):
        record("set_device", device)
        index = device.index if isinstance(device, torch.device) else int(device)
        if not 0 <= index < DEVICE_COUNT:
            raise RuntimeError(f"stand-in has no device {index}")
        _state["current"] = index

    def synchronize(device=None):
        record("synchronize", device)

    def manual_seed_all(seed):
        record("manual_seed_all", int(seed))

    def memory_allocated(device=None):
        record("memory_allocated", device)
        return ALLOCATED

    def max_memory_allocated(device=None):
        record("max_memory_allocated", device)
        return PEAK

    def memory_reserved(device=None):
        record("memory_reserved", device)
        return RESERVED

    def reset_peak_memory_stats(device=None):
        record("reset_peak_memory_stats", device)

    def get_device_properties(device=None):
        record("get_device_properties", device)
        return types.SimpleNamespace(name="stand-in", total_memory=TOTAL + int(device or 0))

    for fn in (is_available, device_count, current_device, set_device, synchronize, manual_seed_all,
               memory_allocated, max_memory_allocated, memory_reserved, reset_peak_memory_stats,
               get_device_properties):
        setattr(cuda, fn.__name__, fn)


if SERVES == "cuda":
    _serve_cuda()
elif SERVES != "cpu":
    raise RuntimeError(f"STANDIN_XMLIR_SERVES={SERVES!r}: expected cuda or cpu")
record("import", SERVES)
