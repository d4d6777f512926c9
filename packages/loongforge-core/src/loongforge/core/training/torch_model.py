"""What the PyTorch-native engine asks of a model: ``TorchModel``, the base class of every module a
``TorchTask.build_model`` returns (and of each of its parts).

A model must say which of its modules repeat (``repeated_blocks``: FSDP2's sharding units and the
compile units). It may override the rest, whose defaults are neutral: one part, no recomputation,
``torch.compile`` of each repeated block, no forward method besides ``forward`` under FSDP2.
"""

from __future__ import annotations

import torch.nn as nn


class TorchModel(nn.Module):
    """Base of a model the torch engine trains (``loongforge.core.training.torch_engine``)."""

    recompute_modes: tuple[str, ...] = ()
    """The ``train.recompute`` values the model implements besides ``none`` (``set_recompute``)."""

    fsdp_forward_methods: tuple[str, ...] = ()
    """Names of methods besides ``forward`` that run the model under FSDP2 (a policy's
    ``sample_actions``)."""

    def parts(self) -> dict[str, nn.Module]:
        """``{name: part}``: the modules the engine wraps and trains separately (Wan 2.2's two
        experts; a ``StepBatch.part`` names the part a step trains). Each part is a ``TorchModel``.
        Default: the model is its one part, ``model``."""
        return {"model": self}

    def repeated_blocks(self) -> list[nn.Module]:
        """The model's repeated blocks, in order: FSDP2's sharding units, the compile units and what
        ``train.offload_layers`` offloads. Every part must implement it."""
        raise NotImplementedError(f"{type(self).__name__}: a TorchModel part implements repeated_blocks()")

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation ``mode``: ``none`` or one of ``recompute_modes`` (the engine
        checks the value first). Default: only ``none``, which changes nothing."""
        if mode != "none":
            raise NotImplementedError(f"{type(self).__name__}: recompute_modes lists {mode!r} but set_recompute "
                                      f"is not implemented")

    def compile_regions(self) -> None:
        """Regional ``torch.compile`` (``train.compile``). Default: each repeated block."""
        for block in self.repeated_blocks():
            block.compile()
