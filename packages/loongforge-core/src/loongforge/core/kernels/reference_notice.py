"""The one line a CUDA run prints when no kernel wheel is installed, so every op runs its PyTorch
reference: the run works, only slower, and the line says which extra brings the fused kernels."""

from __future__ import annotations

from collections.abc import Sequence

FUSED_ACCELERATORS = ("cuda",)  # where loongforge-kernels' fused kernels would run


def reference_kernels_notice(prog: str, accelerator: str, providers: Sequence[str]) -> str | None:
    """The notice for ``prog`` (``lf-llm``, ...) running on ``accelerator`` (its name) with the
    kernel ``providers`` found installed; None when there is nothing to say (a provider is
    installed, or the accelerator has no fused kernels to miss)."""
    if accelerator not in FUSED_ACCELERATORS or providers:
        return None
    install = f"loongforge-{prog.removeprefix('lf-')}[gpu]" if prog.startswith("lf-") else "loongforge-kernels"
    return (f"{prog}: loongforge-kernels is not installed; using the PyTorch reference kernels "
            f'(pip install "{install}")')
