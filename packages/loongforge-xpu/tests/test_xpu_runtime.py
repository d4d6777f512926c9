"""The xpu plugin's runtime binding: clear errors, settings, kernel fallback, megatron adaptations, packaging.

In-process tests put a bare module in ``sys.modules['torch_xmlir']`` (a runtime whose device is
the host: ``LOONGFORGE_XPU_DEVICE_TYPE=cpu``), which changes no torch state.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from loongforge.core.accelerators import AcceleratorError, get_accelerator, installed_accelerators
from loongforge.core.kernels import get_kernel, installed_kernels, installed_ops
from loongforge.xpu import KunlunRuntimeMissing, XpuAccelerator
from loongforge.xpu.runtime import DEVICE_TYPE_ENV, DIST_BACKEND_ENV, TRITON_ENV, load_runtime

PACKAGES = Path(__file__).resolve().parents[2]


@pytest.fixture
def host_runtime(monkeypatch):
    """A stand-in torch_xmlir whose device is the host CPU."""
    for var in (DEVICE_TYPE_ENV, DIST_BACKEND_ENV, TRITON_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "torch_xmlir", types.ModuleType("torch_xmlir"))
    monkeypatch.setenv(DEVICE_TYPE_ENV, "cpu")
    monkeypatch.setenv(DIST_BACKEND_ENV, "gloo")
    return monkeypatch


def test_selecting_xpu_without_the_runtime_fails_clearly(monkeypatch):
    """The plugin is installed, Kunlunxin's runtime is not: LOONGFORGE_ACCELERATOR=xpu is an
    AcceleratorError naming the module and how to install it, and nothing falls back to cpu."""
    assert "xpu" in installed_accelerators()
    for var in (DEVICE_TYPE_ENV, DIST_BACKEND_ENV, TRITON_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setitem(sys.modules, "torch_xmlir", None)  # `import torch_xmlir` raises ImportError
    monkeypatch.setenv("LOONGFORGE_ACCELERATOR", "xpu")
    with pytest.raises(KunlunRuntimeMissing) as err:
        get_accelerator()
    assert isinstance(err.value, AcceleratorError)
    msg = str(err.value)
    assert "LOONGFORGE_ACCELERATOR='xpu'" in msg and "module 'torch_xmlir' cannot be imported" in msg
    assert "xpytorch" in msg and "python -m torch_xmlir --doctor" in msg


def test_runtime_that_fails_to_initialise_is_reported_as_such(monkeypatch, tmp_path):
    (tmp_path / "torch_xmlir.py").write_text("raise RuntimeError('no /dev/xpu0')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_xmlir", raising=False)
    with pytest.raises(AcceleratorError) as err:
        XpuAccelerator()
    assert not isinstance(err.value, KunlunRuntimeMissing)
    assert "failed to initialise: RuntimeError: no /dev/xpu0" in str(err.value)


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        (DEVICE_TYPE_ENV, "kunlun", "is not a torch device type"),
        (DEVICE_TYPE_ENV, "cuda:1", "give a bare device type"),
        (DIST_BACKEND_ENV, "bkcl", "is not a torch.distributed backend"),
        (TRITON_ENV, "yes", "must be 0 or 1"),
    ],
)
def test_bad_settings_name_the_variable_and_value(host_runtime, var, value, message):
    host_runtime.setenv(var, value)
    with pytest.raises(AcceleratorError) as err:
        load_runtime()
    assert f"{var}={value!r}" in str(err.value) and message in str(err.value)


def test_xpytorch_defaults(host_runtime):
    host_runtime.delenv(DEVICE_TYPE_ENV)
    host_runtime.delenv(DIST_BACKEND_ENV)
    runtime = load_runtime()
    assert (runtime.device_type, runtime.dist_backend, runtime.triton) == ("cuda", "nccl", False)
    assert runtime.device_module is torch.cuda
    assert runtime.vendor is sys.modules["torch_xmlir"]


def test_host_runtime_uses_the_host_device_module(host_runtime):
    accel = XpuAccelerator()
    assert (accel.device_type, accel.dist_backend) == ("cpu", "gloo")
    assert accel.runtime.device_module is torch.cpu
    assert accel.device(1) == torch.device("cpu", 0)
    assert accel.memory_stats().allocated == 0  # torch.cpu keeps no allocator statistics


def test_kernels_fall_back_to_torch_references(host_runtime):
    accel = XpuAccelerator()
    for op, contract in installed_ops().items():
        assert get_kernel(op, accelerator=accel, force_reference=False) is contract.reference
    x, w = torch.randn(3, 8), torch.randn(8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(get_kernel("rms_norm", accelerator=accel, force_reference=False)(x, w, 1e-6), expected)


def test_triton_setting_lets_installed_kernels_through(host_runtime):
    fused = installed_kernels()
    if not fused:
        pytest.skip("no kernel wheel (loongforge-kernels) is installed")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    host_runtime.setenv(TRITON_ENV, "1")
    accel = XpuAccelerator()
    assert accel.supports_triton() is True
    for op, impl in fused.items():
        assert get_kernel(op, accelerator=accel, force_reference=False) is impl.fn


def test_megatron_adaptations_refuse_an_unknown_device_type(host_runtime):
    host_runtime.setenv(DEVICE_TYPE_ENV, "mps")
    accel = XpuAccelerator()
    with pytest.raises(AcceleratorError) as err:
        accel.install_megatron_adaptations()
    assert f"{DEVICE_TYPE_ENV}='mps'" in str(err.value)


def test_package_depends_on_core_only_and_is_imported_by_no_other_package():
    requires = importlib.metadata.requires("loongforge-xpu")
    version = importlib.metadata.version("loongforge-xpu")
    assert requires == [f"loongforge-core=={version}"]  # the core of the same release, nothing else
    (ep,) = [e for e in importlib.metadata.entry_points(group="loongforge.accelerators") if e.name == "xpu"]
    assert ep.value == "loongforge.xpu.accelerator:XpuAccelerator"
    pattern = re.compile(r"\bloongforge\.xpu\b|from\s+loongforge\s+import\s+[^\n]*\bxpu\b")
    offenders = [str(p) for p in PACKAGES.glob("*/src/**/*.py")
                 if not p.is_relative_to(PACKAGES / "loongforge-xpu") and pattern.search(p.read_text())]
    assert offenders == []
