"""How a bench sets up the project it is compared against: one ``BaselineRecipe`` per bench,
written as that project recommends for training on a GPU, so a test can assert on it and the bench
prints it.

Options that exist only on CUDA (TF32, fused AdamW, flash-attn kernels) stay in the recipe on any
device as *requested*; ``applied(device_type)`` says which of them the run on this device uses.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class BaselineRecipe:
    """The baseline's settings: ``project`` (e.g. ``diffusers``), ``source`` (where its training
    recipe comes from), ``options`` (name -> value, e.g. ``compile: True``), ``cuda_only`` (the
    options that only take effect on CUDA) and ``notes`` (free-text lines printed after them)."""

    project: str
    source: str
    options: Mapping[str, object]
    cuda_only: frozenset[str] = frozenset()
    notes: tuple[str, ...] = field(default=())

    def __getitem__(self, name: str) -> object:
        return self.options[name]

    def applies(self, name: str, device_type: str) -> bool:
        """Whether option ``name`` takes effect on ``device_type`` (CUDA-only ones only on CUDA)."""
        return name not in self.cuda_only or device_type == "cuda"

    def applied(self, device_type: str) -> dict[str, object]:
        """The options in effect on ``device_type``: a CUDA-only option elsewhere is off (False/None)."""
        return {k: (v if self.applies(k, device_type) else (False if isinstance(v, bool) else None))
                for k, v in self.options.items()}

    def lines(self, device_type: str) -> list[str]:
        """The recipe as printed: one line per option, marked where requested but not applied here."""
        out = [f"baseline: {self.project} ({self.source})"]
        for name, value in self.options.items():
            mark = "" if self.applies(name, device_type) else f"  (requested; CUDA only, not applied on {device_type})"
            out.append(f"  {name} = {value}{mark}")
        out += [f"  {note}" for note in self.notes]
        return out


@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """TF32 for fp32 matmuls and convolutions (``allow_tf32``) inside the block, as training scripts
    that enable it run; the previous settings come back on exit."""
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """transformers' progress bars (``Loading weights``, ``Writing model shards``) off inside the
    block, as a bench saves and loads its baseline's weights; the previous setting comes back on
    exit."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
