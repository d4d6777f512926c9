"""The accelerator contract, checked the same way for cpu, cuda and xpu.

Each plugin runs in its own process (``accelerator_probe.py``: installing megatron adaptations
changes process-wide state) and reports what it observed; the assertions are here. cuda needs a
CUDA device. xpu runs on the recording stand-in of Kunlunxin's runtime (``standin/torch_xmlir``)
in its ``cuda`` role, the way xpytorch builds serve the Kunlun device, so besides the contract
this checks every call the plugin makes on the runtime: device selection, seeding, synchronize,
memory queries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
PROBE = HERE / "accelerator_probe.py"
STANDIN = HERE / "standin"
LOCAL_RANK = 3
HAS_CUDA = torch.cuda.is_available()

EXPECTED = {  # name -> (device type, collective backend)
    "cpu": ("cpu", "gloo"),
    "cuda": ("cuda", "nccl"),
    "xpu": ("cuda", "nccl"),  # xpytorch builds serve the Kunlun device as torch.cuda, collectives as "nccl"
}
CASES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")),
    "xpu",
]

_running: dict[str, subprocess.Popen] = {}
_outputs: dict[str, tuple] = {}
_reports: dict[str, dict] = {}


def _env(name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOONGFORGE_", "STANDIN_"))}
    env.update(OMP_NUM_THREADS="1", LOCAL_RANK=str(LOCAL_RANK))
    if name == "xpu":
        env.update(PYTHONPATH=str(STANDIN), STANDIN_XMLIR_SERVES="cuda")
    return env


def start_background_runs() -> None:
    """Start every probe at once (they run side by side); conftest.py calls this after collection."""
    for name in ("cpu", "cuda", "xpu"):
        if name in _running or (name == "cuda" and not HAS_CUDA):
            continue
        args = [sys.executable, str(PROBE), name] + (["--compile-watch"] if name == "xpu" else [])
        # files, not pipes: the probes run while other tests do, and nobody reads them until then
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        _running[name] = subprocess.Popen(args, env=_env(name), cwd=HERE, stdout=out, stderr=err)
        _outputs[name] = (out, err)


def report(name: str) -> dict:
    if name not in _reports:
        start_background_runs()
        _running[name].wait(timeout=300)
        for f in _outputs[name]:
            f.seek(0)
        out, err = (f.read() for f in _outputs[name])
        assert _running[name].returncode == 0, f"probe {name} failed:\n{err[-4000:]}"
        _reports[name] = json.loads(out.strip().splitlines()[-1])
    return _reports[name]


@pytest.mark.parametrize("name", CASES)
def test_names_its_device_type_and_backend(name):
    r = report(name)
    assert r["is_accelerator"] and r["name"] == name
    assert (r["device_type"], r["dist_backend"]) == EXPECTED[name]
    assert r["backend_registered"]
    assert f"name={name!r}" in r["repr"]


@pytest.mark.parametrize("name", CASES)
def test_maps_local_ranks_to_devices(name):
    r = report(name)
    assert r["is_available"] and r["device_count"] >= 1
    if r["device_type"] == "cpu":
        assert r["device_rank0"] == r["device_rank3"] == r["device_default"] == "cpu"
    else:
        assert r["device_rank0"] == f"{r['device_type']}:0"
        assert r["device_rank3"] == f"{r['device_type']}:{LOCAL_RANK % r['device_count']}"
        assert r["device_default"] == r["device_rank3"]  # LOCAL_RANK from the environment


@pytest.mark.parametrize("name", CASES)
def test_refuses_a_device_of_another_type(name):
    assert report(name)["set_foreign_device_raises"] is not None


@pytest.mark.parametrize("name", CASES)
def test_manual_seed_seeds_the_host_generator(name):
    first, again, other = report(name)["seed_draws"]
    torch.manual_seed(7)
    assert first == again == torch.rand(4).tolist()
    assert other != first


@pytest.mark.parametrize("name", CASES)
def test_synchronize_and_peak_reset_return_nothing(name):
    r = report(name)
    assert r["synchronize_returns"] == "None" and r["reset_peak_returns"] == "None"


@pytest.mark.parametrize("name", CASES)
def test_memory_stats_are_consistent_byte_counts(name):
    r = report(name)
    m = r["memory"]
    assert r["memory_is_stats"]
    assert all(isinstance(v, int) and v >= 0 for v in m.values())
    assert m["peak_allocated"] >= m["allocated"]
    assert m["reserved"] >= m["allocated"]
    assert m["total"] >= m["reserved"]


@pytest.mark.parametrize("name", CASES)
def test_megatron_adaptations_are_idempotent(name):
    r = report(name)
    assert r["adaptations_first"] == r["adaptations_second"]
    assert all(isinstance(a, str) for a in r["adaptations_first"])
    expected = {"cuda": [], "xpu": ["compile_eagerly"]}
    if name in expected:
        assert r["adaptations_first"] == expected[name]
    else:
        assert "current_device" in r["adaptations_first"] and "rng_tracker" in r["adaptations_first"]


@pytest.mark.parametrize("name", CASES)
def test_triton_support_and_peak_flops(name):
    r = report(name)
    assert isinstance(r["supports_triton"], bool)
    if name in ("cpu", "xpu"):
        assert r["supports_triton"] is False  # fused kernels fall back to their torch references
    assert r["peak_flops_bf16"] is None or r["peak_flops_bf16"] > 0


def test_xpu_imports_the_runtime_when_instantiated_not_when_loaded():
    r = report("xpu")
    assert r["runtime_imported_by_entry_point"] is False
    assert r["runtime_imported_by_instance"] is True


def test_xpu_adaptations_make_compiled_fusions_run_eagerly():
    """megatron's jit_fuser wraps fusions in torch.compile when its modules are imported; after the
    xpu adaptations a function compiled before them is not traced again (the new input shape would
    otherwise trace it) and still computes the right result."""
    r = report("xpu")
    assert r["compile_traced_shapes"] == [[3]]
    assert r["compiled_result_correct"] == [True, True]


def test_xpu_every_runtime_call():
    """The probe's steps, in order, and the exact calls each one made on the stand-in runtime."""
    count = ["device_count"]
    assert report("xpu")["runtime_calls"] == [
        ["import", "cuda"],  # instantiation
        ["is_available"], count,  # is_available()
        count,  # device_count()
        count, count, count,  # device(0), device(3), device()
        count, ["set_device", "cuda:1"],  # set_device(device()); the foreign device never reaches it
        ["manual_seed_all", 7], ["manual_seed_all", 7], ["manual_seed_all", 8],  # manual_seed(7, 7, 8)
        ["synchronize", None],
        ["memory_allocated", None], ["max_memory_allocated", None], ["memory_reserved", None],
        ["current_device"], ["get_device_properties", 1],  # total memory of the current device
        ["reset_peak_memory_stats", None],
    ]  # installing adaptations, triton and flops queries make no runtime call


def test_xpu_memory_stats_come_from_the_runtime_allocator():
    # the stand-in's allocator answers 1000 / 5000 / 8192 bytes and 96 GiB plus the device index
    assert report("xpu")["memory"] == {"allocated": 1_000, "peak_allocated": 5_000, "reserved": 8_192,
                                       "total": 96 * 2**30 + 1}
