"""The one line a CUDA run prints when no kernel wheel is installed: decided from the accelerator's
name and the providers found, so CPU tests cover the CUDA case."""

from __future__ import annotations

from loongforge.core.kernels import installed_providers
from loongforge.core.kernels.reference_notice import reference_kernels_notice
from loongforge.core.training.run import print_kernels_notice

TRITON = "loongforge-kernels: loongforge.kernels.provider:fused_kernels"


def test_cuda_without_a_provider_names_the_modality_gpu_extra():
    assert reference_kernels_notice("lf-llm", "cuda", []) == (
        'lf-llm: loongforge-kernels is not installed; using the PyTorch reference kernels '
        '(pip install "loongforge-llm[gpu]")')
    assert reference_kernels_notice("lf-diffusion", "cuda", ()).endswith('(pip install "loongforge-diffusion[gpu]")')
    assert reference_kernels_notice("my-tool", "cuda", []).endswith('(pip install "loongforge-kernels")')


def test_nothing_to_say_with_a_provider_or_off_cuda():
    assert reference_kernels_notice("lf-llm", "cuda", [TRITON]) is None
    for accelerator in ("cpu", "xpu"):
        assert reference_kernels_notice("lf-llm", accelerator, []) is None


def test_the_workspace_has_the_triton_provider_and_a_cpu_run_prints_nothing(capsys):
    assert TRITON in installed_providers()
    print_kernels_notice("lf-llm", "cpu")
    assert capsys.readouterr().out == ""
