"""The interface between the loop and an engine (``engine_choice.make_engine`` picks one).

An engine holds the model (wrapped for its kind of parallelism) and the optimizer, and runs the
two halves of a step:

- ``forward_backward(step)``: every micro-batch of the ``StepBatch`` forward and backward,
  gradients reduced over data parallelism and normalised by the global loss count, the global
  gradient norm computed; the weights are not touched yet. Returns a ``StepOutput``.
- ``apply_update(lr)``: clip to ``train.clip_grad`` with that norm, step the optimizer at ``lr``,
  clear the gradients; or ``discard_update()``: clear them without stepping.

Between the two the loop checks the loss and the norm are finite, so an update from a
non-finite gradient is never applied. Engines also save and load their state in the core
checkpoint format (``checkpoint_state`` / ``load_checkpoint``) and report their RNG streams.

Two engines ship with core: ``megatron`` (``MegatronEngine``: TP/PP/CP/EP, megatron DDP, the
distributed optimizer, pipeline schedules) and ``torch`` (``TorchEngine``: DDP / FSDP2 / HSDP,
``torch.compile``, activation checkpointing, EMA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from loongforge.core.training.task import StepBatch

ENGINES = ("megatron", "torch")


@dataclass
class StepOutput:
    loss: float  # mean over the global batch (loss sum / count, summed over micro-batches and ranks)
    grad_norm: float  # global, before clipping
    tokens: int | None = None  # input tokens of the global batch (None: not token data)
    flops: float | None = None  # training FLOPs of the global batch (None: unknown)
    compute_seconds: float = float("nan")  # this rank's forward+backward, up to the gradient reduction
    offloaded_bytes: int | None = None  # activations this rank moved to host memory (train.offload_layers)


@dataclass
class EngineState:
    """What an engine contributes to a checkpoint: tensor pieces (``loongforge.core.checkpoint.Piece``),
    this rank's objects, and manifest entries."""

    pieces: list = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    name: str
    dtype: torch.dtype  # the compute dtype
    precision: str  # the recipe (``precision_recipe``): mixed | pure | fp32
    model: torch.nn.Module  # as wrapped for training

    @property
    def inner_model(self) -> torch.nn.Module:
        """The task's model inside the engine's wrappers."""

    def forward_backward(self, step: StepBatch, measuring: bool = False) -> StepOutput: ...

    def apply_update(self, lr: float) -> None: ...

    def discard_update(self) -> None: ...

    def layout_record(self) -> dict: ...

    def checkpoint_state(self) -> EngineState: ...

    def load_checkpoint(self, ckpt, with_optimizer: bool) -> None: ...

    def rng_state(self) -> dict: ...

    def set_rng_state(self, state: dict) -> None: ...


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The compute dtype of ``train.precision``: auto is bf16 on accelerators, fp32 on CPU."""
    if precision == "auto":
        return torch.bfloat16 if device.type != "cpu" else torch.float32
    return {"bf16": torch.bfloat16, "bf16-pure": torch.bfloat16, "fp32": torch.float32}[precision]


def precision_recipe(precision: str, device: torch.device) -> str:
    """What ``train.precision`` keeps in which dtype, by name: ``mixed`` (bf16 compute, fp32 main
    weights, gradients and optimizer state), ``pure`` (everything in bf16, as a model loaded in
    bf16 and trained by a plain optimizer is) or ``fp32``. Checkpoints record it; a resume with
    another recipe takes the weights only."""
    if precision == "bf16-pure":
        return "pure"
    return "mixed" if resolve_dtype(precision, device) == torch.bfloat16 else "fp32"


def check_precision(ckpt, precision: str) -> None:
    """Optimizer state is kept in the dtypes of the precision recipe that saved it (``mixed``: fp32
    main weights and moments; ``pure``: bf16): a resume must train with the same recipe. Checkpoints
    from before the manifest recorded one pass."""
    from loongforge.core.checkpoint import CheckpointReadError

    saved = ckpt.manifest.get("precision")
    if saved is not None and saved != precision:
        raise CheckpointReadError(
            f"{ckpt.directory / 'manifest.json'}: saved by a run with the {saved} precision recipe; this run trains "
            f"with the {precision} one (train.precision: bf16 is mixed, bf16-pure is pure); resume with the same "
            f"train.precision, or load the weights only with checkpoint.load=DIR and checkpoint.resume=false"
        )
