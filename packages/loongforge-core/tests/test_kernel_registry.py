"""The notice a CUDA run prints when no kernel wheel is installed."""


def test_reference_kernels_notice_only_on_cuda_without_a_kernel_wheel():
    from loongforge.core.kernels.registry import reference_kernels_notice

    line = reference_kernels_notice("cuda", [], "loongforge-llm")
    assert line is not None and "loongforge-kernels is not installed" in line and 'pip install "loongforge-llm[gpu]"' in line
    assert reference_kernels_notice("cuda", ["loongforge.kernels.provider:kernels"], "loongforge-llm") is None
    assert reference_kernels_notice("cpu", [], "loongforge-llm") is None
    assert reference_kernels_notice("xpu", [], "loongforge-vlm") is None
