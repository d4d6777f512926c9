"""Exercise one accelerator plugin through the contract and print what it observed, as JSON.

    python accelerator_probe.py NAME [--compile-watch]

Run in a fresh process by test_accelerator_contract.py: installing megatron adaptations changes
process-wide state, and the xpu case needs its stand-in runtime on ``sys.path``. The probe only
observes; the test module holds the assertions. The last stdout line is the JSON report.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from loongforge.core.accelerators import Accelerator, MemoryStats, installed_accelerators, load_accelerator


def _raises(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the contract only asks that it refuses
        return type(exc).__name__
    return None


class CompileWatch:
    """A torch.compile'd function (compiled before the plugin is loaded, as megatron's fusions are
    at import) that records each time the compiler backend traces it."""

    def __init__(self):
        self.traced: list[list[int]] = []

        def backend(gm, example_inputs):
            self.traced.append(list(example_inputs[0].shape))
            return gm.forward

        self.fn = torch.compile(lambda t: torch.nn.functional.silu(t) * 2, backend=backend, dynamic=False)

    def call(self, n: int) -> bool:
        x = torch.randn(n)
        return torch.equal(self.fn(x), torch.nn.functional.silu(x) * 2)


def probe(name: str) -> dict:
    obs: dict = {}
    watch = CompileWatch() if "--compile-watch" in sys.argv else None
    if watch:
        obs["compiled_result_correct"] = [watch.call(3)]
    installed_accelerators()[name].load()
    obs["runtime_imported_by_entry_point"] = "torch_xmlir" in sys.modules
    accel = load_accelerator(name)
    obs["runtime_imported_by_instance"] = "torch_xmlir" in sys.modules
    obs["is_accelerator"] = isinstance(accel, Accelerator)
    obs.update(name=accel.name, device_type=accel.device_type, dist_backend=accel.dist_backend)
    obs["backend_registered"] = accel.dist_backend in dist.Backend.backend_list
    obs["is_available"] = accel.is_available()
    obs["device_count"] = accel.device_count()
    obs["device_rank0"] = str(accel.device(0))
    obs["device_rank3"] = str(accel.device(3))
    obs["device_default"] = str(accel.device())  # LOCAL_RANK from the environment
    accel.set_device(accel.device())
    obs["set_foreign_device_raises"] = _raises(lambda: accel.set_device(torch.device("meta")))
    draws = []
    for seed in (7, 7, 8):
        accel.manual_seed(seed)
        draws.append(torch.rand(4).tolist())
    obs["seed_draws"] = draws
    obs["synchronize_returns"] = repr(accel.synchronize())
    stats = accel.memory_stats()
    obs["memory_is_stats"] = isinstance(stats, MemoryStats)
    obs["memory"] = dataclasses.asdict(stats)
    obs["reset_peak_returns"] = repr(accel.reset_peak_memory_stats())
    obs["adaptations_first"] = accel.install_megatron_adaptations()
    obs["adaptations_second"] = accel.install_megatron_adaptations()
    if watch:
        obs["compiled_result_correct"].append(watch.call(5))
        obs["compile_traced_shapes"] = watch.traced
    obs["supports_triton"] = accel.supports_triton()
    peak = accel.peak_flops(torch.bfloat16)
    obs["peak_flops_bf16"] = peak
    obs["repr"] = repr(accel)
    standin = sys.modules.get("torch_xmlir")
    obs["runtime_calls"] = list(getattr(standin, "CALLS", [])) if standin else None
    return obs


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
