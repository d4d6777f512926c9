"""The wheel's entry point, how get_kernel chooses between fused and reference ops, and the op
contracts the packages define (core's generic ops, loongforge-llm's, loongforge-diffusion's)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest
import torch

from loongforge.core.accelerators import get_accelerator
from loongforge.core.accelerators.cpu import CpuAccelerator
from loongforge.core.accelerators.cuda import CudaAccelerator
from loongforge.core.kernels import KernelRegistryError, get_kernel, get_op, installed_kernels, installed_ops
from loongforge.core.kernels.registry import ENTRY_POINT_GROUP, OPS_GROUP, OpRegistry
from loongforge.kernels import provider

PROVIDER = "loongforge.kernels.provider:fused_kernels"


class TritonCapableCpu(CpuAccelerator):
    """Stands in for a GPU accelerator: claims Triton support (the kernels run interpreted here)."""

    def supports_triton(self) -> bool:
        return True


def _definition(op: str, value: str) -> EntryPoint:
    return EntryPoint(name=op, value=value, group=OPS_GROUP)


def _registry(*definitions: EntryPoint) -> OpRegistry:
    """A registry of these op definitions and this wheel's provider."""
    return OpRegistry(definitions, [EntryPoint(name="triton", value=PROVIDER, group=ENTRY_POINT_GROUP)])


def test_every_op_is_registered_through_the_entry_point():
    kernels = installed_kernels()
    assert set(kernels) == set(installed_ops())
    for name in kernels:
        assert kernels[name].provider == PROVIDER
        assert kernels[name].fn is getattr(provider, name)


def test_each_op_is_defined_by_the_package_that_owns_it():
    owners = {"rms_norm": "loongforge-core", "fp8_cast_transpose": "loongforge-diffusion",
              "modulated_layer_norm": "loongforge-diffusion", "dsa_indexer_topk": "loongforge-llm",
              "fp8_linear": "loongforge-llm", "qk_norm_rope": "loongforge-diffusion",
              "qk_norm_rope_backward": "loongforge-diffusion"}
    for op, package in owners.items():
        assert get_op(op).source.startswith(f"{package}: "), get_op(op).source
    from loongforge.llm.ops import dsa

    assert get_op("sparse_mla_attention").reference is dsa.sparse_mla_attention


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
        assert get_kernel(name, accelerator=CpuAccelerator()) is get_op(name).reference
    expected = provider.rms_norm if get_accelerator().supports_triton() else get_op("rms_norm").reference
    assert get_kernel("rms_norm") is expected


def test_env_and_flag_force_the_reference(monkeypatch):
    monkeypatch.setenv("LOONGFORGE_KERNELS", "reference")
    for name, contract in installed_ops().items():
        assert get_kernel(name, accelerator=TritonCapableCpu()) is contract.reference
    monkeypatch.setenv("LOONGFORGE_KERNELS", "auto")
    assert get_kernel("swiglu", accelerator=TritonCapableCpu()) is provider.swiglu
    assert get_kernel("swiglu", accelerator=TritonCapableCpu(), force_reference=True) is get_op("swiglu").reference


def test_a_package_defined_op_is_overridden_by_a_provider(monkeypatch):
    """An op of loongforge-llm (not core) gets this wheel's fused version where it runs."""
    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    from loongforge.llm.ops import dsa

    registry = _registry(_definition("dsa_indexer_topk", "loongforge.llm.ops.dsa:dsa_indexer_topk"))
    assert registry.resolve("dsa_indexer_topk", TritonCapableCpu()) is provider.dsa_indexer_topk
    assert registry.resolve("dsa_indexer_topk", CpuAccelerator()) is dsa.dsa_indexer_topk
    assert registry.contract("dsa_indexer_topk").reference is dsa.dsa_indexer_topk


def test_a_provider_op_that_no_package_defines_is_an_error_naming_it(monkeypatch):
    """With only core's rms_norm defined (as where loongforge-llm and -diffusion are not
    installed), listing the providers names the ops they implement without a definition, and so
    does looking one of them up; the defined op still resolves."""
    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    registry = _registry(_definition("rms_norm", "loongforge.core.kernels.reference:rms_norm"))
    with pytest.raises(KernelRegistryError, match=rf"'qk_norm_rope' \(by {PROVIDER}\)") as listed:
        registry.kernels()
    assert "'dsa_indexer_topk'" in str(listed.value) and "'rms_norm'" not in str(listed.value)
    with pytest.raises(KernelRegistryError, match=r"no installed package defines: 'sparse_mla_attention' \(by "):
        registry.resolve("sparse_mla_attention", TritonCapableCpu())
    assert registry.resolve("rms_norm", TritonCapableCpu()) is provider.rms_norm


def test_an_op_defined_twice_names_both_sources():
    registry = _registry(_definition("rms_norm", "loongforge.core.kernels.reference:rms_norm"),
                         _definition("rms_norm", "loongforge.llm.ops.dsa:indexer_scores"))
    with pytest.raises(KernelRegistryError, match="op 'rms_norm' is defined twice: by "
                       "loongforge.core.kernels.reference:rms_norm and by loongforge.llm.ops.dsa:indexer_scores"):
        registry.contract("rms_norm")


def test_an_unknown_op_lists_the_known_ones():
    known = r"known: .*dsa_indexer_topk.*qk_norm_rope.*rms_norm"
    with pytest.raises(KernelRegistryError, match=rf"unknown kernel op 'rms_nrom'; {known}"):
        get_kernel("rms_nrom")


def test_looking_up_an_op_imports_only_the_package_that_defines_it():
    """core's op imports neither modality; loongforge-llm's imports it alone (not megatron); the
    diffusion op imports its ops package, not diffusers or the Wan model."""
    script = """
import sys
from loongforge.core.kernels import get_kernel, get_op

def loaded():
    names = ("loongforge.llm", "loongforge.diffusion", "diffusers", "megatron", "loongforge.diffusion.model")
    return ",".join(m for m in names if m in sys.modules)

get_kernel("rms_norm")
print(loaded())
get_op("dsa_indexer_topk")
print(loaded())
get_kernel("qk_norm_rope")
print(loaded())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["", "loongforge.llm", "loongforge.llm,loongforge.diffusion"], proc.stdout


def test_the_selected_fused_op_runs_the_kernel_and_matches(monkeypatch):
    monkeypatch.delenv("LOONGFORGE_KERNELS", raising=False)
    torch.manual_seed(0)
    x = torch.randn(4, 19, requires_grad=True)
    w = torch.randn(19)
    fused = get_kernel("rms_norm", accelerator=TritonCapableCpu())
    y = fused(x, w)
    assert type(y.grad_fn).__name__ == "_RMSNormBackward"  # the Triton autograd function, not torch ops
    torch.testing.assert_close(y, get_op("rms_norm").reference(x, w), rtol=1e-5, atol=1e-5)


def test_cpu_tensors_without_the_interpreter_run_the_reference(monkeypatch):
    """A model kept on the host of a GPU machine: the fused op hands CPU tensors to the torch
    reference instead of the Triton launcher, which refuses them when not interpreted."""
    from loongforge.kernels import launch

    x, w = torch.randn(6, 64, device="cpu"), torch.randn(64, device="cpu")
    monkeypatch.setattr(launch, "INTERPRETED", False)
    with pytest.raises(ValueError, match="runs on a GPU but got CPU tensors"):
        launch.check_tensors("rms_norm", x, w)
    out = provider.rms_norm(x, w)
    torch.testing.assert_close(out, get_op("rms_norm").reference(x, w), rtol=0, atol=0)
