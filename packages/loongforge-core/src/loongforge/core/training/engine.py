"""The interface between the loop and an engine (``engine_choice.make_engine`` picks one).

An engine holds the model (wrapped for its kind of parallelism) and the optimizer, and runs a
step:

- ``train_step(step, lr)``: every micro-batch of the ``StepBatch`` forward and backward,
  gradients reduced over data parallelism and normalised by the global loss count, the global
  gradient norm computed, then the update: clipped to ``train.clip_grad`` with that norm, the
  optimizer stepped at ``lr``, the gradients cleared. A step whose loss or gradient norm is not
  finite (``finite``) is never applied: its gradients are dropped. Where the optimizer can skip
  on the device (torch's fused AdamW's ``found_inf``) the decision is made there and the step's
  numbers are read back once, after the update is queued; otherwise they are read first. Returns
  a ``StepOutput``; the loop counts the non-finite steps.
- ``forward_backward(step)``: the first half alone (the weights untouched), for measurements.

Two engines ship with core: ``megatron`` (``MegatronEngine``: TP/PP/CP/EP, megatron DDP, the
distributed optimizer, pipeline schedules) and ``torch`` (``TorchEngine``: DDP / FSDP2 / HSDP,
``torch.compile``, activation checkpointing, EMA).
"""

from __future__ import annotations

import math
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


def finite(out: StepOutput) -> bool:
    """Whether a step's loss and gradient norm are finite (its update may be applied)."""
    return math.isfinite(out.loss) and math.isfinite(out.grad_norm)


def read_step_output(step: StepBatch, on_device: list[torch.Tensor], on_host: list[float] | None = None, *,
                     compute_seconds: float, offloaded_bytes: int | None) -> StepOutput:
    """A step's ``StepOutput``, its device numbers read back to the host in one read: ``on_device``
    holds the loss and gradient norm, then the input tokens and FLOPs unless ``on_host`` has those
    two (one dtype: they are stacked). Tokens and FLOPs are reported only where ``step`` counts them."""
    values = torch.stack(on_device).tolist()
    if on_host is not None:
        values += on_host
    loss, norm, tokens, flops = values
    return StepOutput(
        loss=loss,
        grad_norm=norm,
        tokens=int(tokens) if step.tokens is not None else None,
        flops=flops if step.flops is not None else None,
        compute_seconds=compute_seconds,
        offloaded_bytes=offloaded_bytes,
    )


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

    def train_step(self, step: StepBatch, lr: float, measuring: bool = False) -> StepOutput: ...

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
