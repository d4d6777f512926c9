"""The wheel's entry point and how get_kernel chooses between fused and reference ops."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.accelerators import get_accelerator
from loongforge.core.accelerators.cpu import CpuAccelerator
from loongforge.core.accelerators.cuda import CudaAccelerator
from loongforge.core.kernels import REFERENCE_OPS, get_kernel, installed_kernels
from loongforge.kernels import provider

PROVIDER = "loongforge.kernels.provider:fused_kernels"


class TritonCapableCpu(CpuAccelerator):
    """Stands in for a GPU accelerator: claims Triton support (the kernels run interpreted here)."""

    def supports_triton(self) -> bool:
        return True


def test_every_op_is_registered_through_the_entry_point():
    kernels = installed_kernels()
    assert set(kernels) == set(REFERENCE_OPS)
    for name in kernels:
        assert kernels[name].provider == PROVIDER
        assert kernels[name].fn is getattr(provider, name)


def test_supports_follows_the_accelerator():
    assert provider.supports(TritonCapableCpu())
    assert not provider.supports(CpuAccelerator())
    assert provider.supports(CudaAccelerator()) == torch.cuda.is_available()
    assert not provider.supports_fp8(CpuAccelerator())
    fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    assert provider.supports_fp8(CudaAccelerator()) == fp8_gpu


def test_get_kernel_picks_fused_only_where_supported(monkeypatch):
    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    for name in installed_kernels():
        assert get_kernel(name, accelerator=TritonCapableCpu()) is getattr(provider, name)
        assert get_kernel(name, accelerator=CpuAccelerator()) is REFERENCE_OPS[name]
    expected = provider.rms_norm if get_accelerator().supports_triton() else REFERENCE_OPS["rms_norm"]
    assert get_kernel("rms_norm") is expected


def test_env_and_flag_force_the_reference(monkeypatch):
    monkeypatch.setenv("LOONGFORGE_KERNELS", "reference")
    for name, ref in REFERENCE_OPS.items():
        assert get_kernel(name, accelerator=TritonCapableCpu()) is ref
    monkeypatch.setenv("LOONGFORGE_KERNELS", "auto")
    assert get_kernel("swiglu", accelerator=TritonCapableCpu()) is provider.swiglu
    assert get_kernel("swiglu", accelerator=TritonCapableCpu(), force_reference=True) is REFERENCE_OPS["swiglu"]


def test_the_selected_fused_op_runs_the_kernel_and_matches(monkeypatch):
    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    torch.manual_seed(0)
    x = torch.randn(4, 19, requires_grad=True)
    w = torch.randn(19)
    fused = get_kernel("rms_norm", accelerator=TritonCapableCpu())
    y = fused(x, w)
    assert type(y.grad_fn).__name__ == "_RMSNormBackward"  # the Triton autograd function, not torch ops
    torch.testing.assert_close(y, REFERENCE_OPS["rms_norm"](x, w), rtol=1e-5, atol=1e-5)


def test_cpu_tensors_without_the_interpreter_run_the_reference(monkeypatch):
    """A model kept on the host of a GPU machine: the fused op hands CPU tensors to the torch
    reference instead of the Triton launcher, which refuses them when not interpreted."""
    from loongforge.kernels import launch

    x, w = torch.randn(6, 64, device="cpu"), torch.randn(64, device="cpu")
    monkeypatch.setattr(launch, "INTERPRETED", False)
    with pytest.raises(ValueError, match="runs on a GPU but got CPU tensors"):
        launch.check_tensors("rms_norm", x, w)
    out = provider.rms_norm(x, w)
    torch.testing.assert_close(out, REFERENCE_OPS["rms_norm"](x, w), rtol=0, atol=0)
