import pytest
import torch

from loongforge.core.accelerators import (
    Accelerator,
    AcceleratorError,
    get_accelerator,
    installed_accelerators,
    load_accelerator,
)


def test_builtin_plugins_are_registered():
    names = set(installed_accelerators())
    assert {"cpu", "cuda"} <= names


def test_cpu_accelerator_contract():
    cpu = load_accelerator("cpu")
    assert isinstance(cpu, Accelerator)
    assert (cpu.device_type, cpu.dist_backend) == ("cpu", "gloo")
    assert cpu.device() == torch.device("cpu")
    cpu.manual_seed(7)
    a = torch.rand(3)
    cpu.manual_seed(7)
    assert torch.equal(a, torch.rand(3))
    stats = cpu.memory_stats()
    assert 0 < stats.allocated <= stats.total


def test_auto_picks_cpu_without_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("LOONGFORGE_ACCELERATOR", "auto")
    assert get_accelerator().name == "cpu"


def test_unknown_accelerator_lists_installed():
    with pytest.raises(AcceleratorError) as err:
        load_accelerator("tpu")
    msg = str(err.value)
    assert "'tpu'" in msg and "cpu" in msg and "cuda" in msg


def test_xpu_without_plugin_fails_clearly(monkeypatch):
    """LOONGFORGE_ACCELERATOR=xpu with no xpu plugin installed: a clear error, no fallback. (The
    workspace installs loongforge-xpu, so its entry point is hidden here.)"""
    from loongforge.core.accelerators import registry

    without_xpu = {name: ep for name, ep in registry.installed_accelerators().items() if name != "xpu"}
    monkeypatch.setattr(registry, "installed_accelerators", lambda: without_xpu)
    monkeypatch.setenv("LOONGFORGE_ACCELERATOR", "xpu")
    registry._select.cache_clear()
    try:
        with pytest.raises(AcceleratorError) as err:
            get_accelerator()
    finally:
        registry._select.cache_clear()
    msg = str(err.value)
    assert "LOONGFORGE_ACCELERATOR='xpu'" in msg and "installed: cpu, cuda)" in msg
    assert "pip install loongforge-xpu" in msg
