"""What a modality hands the loop: a task, built from the run's config by the model family's spec.

Every task subclasses ``MegatronTask`` or ``TorchTask`` (both ``TrainTask``), which declare every
hook the loop and the engines call: the required ones abstract, the optional ones with a neutral
default (the loop never probes a task with ``getattr``). A task says which engine runs it
(``engine``: ``"megatron"`` or ``"torch"``, set by its base class), builds the model the way that
engine wants it, yields each step's micro-batches, and scores a micro-batch:

- ``steps(ctx, start_step)`` yields, per optimizer step, a ``StepBatch`` of this DP rank's
  micro-batches (every rank of one DP replica, i.e. its TP, PP and CP ranks, gets the same ones).
  With ``variable_micro_batches = True`` the number may differ from step to step and from rank to
  rank (a task that plans them, e.g. with the DP load balancer); otherwise it is
  ``global_batch_size / (micro_batch_size * dp)``. The iterator may keep state for checkpoints
  (``state_dict()`` / ``load_state_dict(state)``) and take measurements (``measuring``,
  ``record_compute_seconds(seconds)``), as ``loongforge.core.training.balanced.BalancedSteps`` does.
- ``forward(model, micro_batch)`` returns ``(output, loss_fn)``; ``loss_fn(output)`` returns
  ``(loss_sum, count)``: the micro-batch's summed loss and what it is normalised by (tokens,
  elements, samples). The engine sums both over every micro-batch and data-parallel rank of the
  step and divides, so any split of a global batch gives the same loss and gradients. On the
  megatron-core engine ``output`` is the last pipeline stage's (other stages never call
  ``loss_fn``).

The engine-specific half is the model build: ``MegatronTask.build_model`` receives megatron's
``TransformerConfig`` and the pipeline-stage flags; ``TorchTask.build_model`` builds the whole
model and ``TorchTask.load_pretrained`` fills it (or its FSDP shards) with pretrained weights.
A ``MegatronTask`` may also do part of a step outside megatron's per-micro-batch schedule
(``before_schedule``, returning a ``ScheduledStep``): work on all the step's micro-batches at once
before the schedule starts, and its backward after the schedule's last backward. A task that turns
on megatron's MoE all-to-all overlap hands its combined 1F1B schedule the model's schedule plan of
a micro-batch in place of its output (``schedule_plan``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepBatch:
    """One step of one DP rank."""

    micro_batches: list[Any]
    tokens: int | None = None  # input tokens of this DP replica's micro-batches (throughput); None: not token data
    flops: float | None = None  # training FLOPs of this DP replica's micro-batches (MFU); None: unknown
    metrics: dict[str, float] = field(default_factory=dict)  # logged with the step (the same on every rank)
    sample_ids: list[int] = field(default_factory=list)  # dataset indices trained by this DP replica
    part: str | None = None  # the model part this step trains (a model of separately wrapped parts)


LossFn = Callable[[Any], tuple[torch.Tensor, torch.Tensor | float]]


class TrainTask(ABC):
    """Base of every task. A subclass sets ``family`` and implements ``model_config_dict``,
    ``steps`` and ``forward`` (and its engine's base class's ``build_model``); every other hook
    below has a neutral default that it may override. The loop and the engines call exactly these
    hooks (``tests/test_task_contract.py``)."""

    family: str
    """Registry name of the model family (recorded in checkpoints)."""

    engine: str
    """``"megatron"`` or ``"torch"``: set by ``MegatronTask`` / ``TorchTask``."""

    variable_micro_batches: bool = False
    """Whether the number of micro-batches may differ between steps and ranks (see the module docstring)."""

    model_section: str | None = "model"
    """The config group the model config lives in, named in the resume check's errors (None: the
    model config's keys are groups of their own)."""

    @abstractmethod
    def model_config_dict(self) -> dict:
        """The full model config, recorded in checkpoint manifests and checked on resume."""

    @abstractmethod
    def steps(self, ctx, start_step: int) -> Iterator[StepBatch]:
        """This rank's ``StepBatch`` of every step from ``start_step`` (0-based) on."""

    @abstractmethod
    def forward(self, model, micro_batch) -> tuple[Any, LossFn]:
        """Run one micro-batch; see the module docstring."""

    def prepare(self, ctx) -> None:
        """Collective set-up every rank runs before the trainer is built (e.g. a data index the ranks
        build together). Default: nothing."""

    def describe(self) -> str:
        """What the run trains, in the first line a run prints. Default: ``family``."""
        return self.family

    def tokenizer_ref(self) -> str | None:
        """The tokenizer recorded in checkpoint manifests (None: the task has none)."""
        return None

    def manifest_fields(self) -> dict:
        """More checkpoint manifest entries (e.g. the data root, a measured plan). Default: none."""
        return {}

    def restore(self, manifest: dict) -> None:
        """A resumed run's latest manifest, before the model is built: state the task saved through
        ``manifest_fields`` which its model build depends on. Default: nothing."""

    def check_resume(self, manifest: dict) -> None:
        """Refuse (``ValueError``) a checkpoint the task cannot continue. Default: accept."""

    def evaluate(self, model, ctx) -> dict[str, float]:
        """The evaluation hook, every ``eval.interval`` steps: metric name -> value (logged as
        ``eval/<name>``). Default: no metric."""
        return {}

    def flops_per_token(self, seq_length: int) -> float | None:
        """Training FLOPs per token at ``seq_length`` (MFU of token models; used when a step reports
        no ``flops``). None: unknown."""
        return None


@dataclass
class ScheduledStep:
    """What ``MegatronTask.before_schedule`` hands the megatron engine for one step: the micro-batches
    its schedule runs (in order; each as ``forward`` receives it), and ``after_schedule``, which
    the engine calls after the schedule's last backward and before the gradient reduction (the
    backward of what ``before_schedule`` computed for all the micro-batches)."""

    micro_batches: list[Any]
    after_schedule: Callable[[], None]


class MegatronTask(TrainTask):
    """Base of a task on the megatron-core engine."""

    engine = "megatron"

    @abstractmethod
    def transformer_config_kwargs(self) -> dict:
        """Architecture fields of megatron's TransformerConfig."""

    @abstractmethod
    def build_model(self, ctx, transformer_config, pre_process: bool, post_process: bool,
                    load_initial_weights: bool = True) -> torch.nn.Module:
        """This rank's model chunk. ``load_initial_weights`` is False when the run resumes from its
        own checkpoint, which holds every weight: pretrained weights the task would read (a Hugging
        Face model, a LoRA base) are not read again."""

    def schedule_plan(self, model, micro_batch) -> tuple[Any, LossFn]:
        """``forward``'s counterpart for megatron's combined 1F1B schedule (the task's
        ``transformer_config_kwargs`` set ``overlap_moe_expert_parallel_comm``: one micro-batch's MoE
        all-to-all overlaps another's computation): ``(the model's schedule plan of the micro-batch,
        loss_fn)``, ``loss_fn`` as ``forward``'s. Default: refused (a task that never turns the
        overlap on is never asked)."""
        raise NotImplementedError(f"{type(self).__name__} has no schedule plan for megatron's combined 1F1B "
                                  "schedule (overlap_moe_expert_parallel_comm)")

    def before_schedule(self, model, micro_batches: list[Any]) -> ScheduledStep | None:
        """Called with this rank's model chunk as ``build_model`` made it (the engine's
        ``inner_model``, without megatron's DDP and Float16Module wrappers) and the step's
        micro-batches, before megatron's schedule starts. Default None: the schedule runs the
        micro-batches as they are."""
        return None


class TorchTask(TrainTask):
    """Base of a task on the PyTorch-native engine; its model is a
    ``loongforge.core.training.torch_model.TorchModel``."""

    engine = "torch"

    context_parallel: bool = False
    """Whether the model implements context parallelism (``parallel.cp > 1`` is refused otherwise)."""

    loads_into_shards: bool = False
    """``load_pretrained`` fills every tensor of the state dict (buffers included) into FSDP2 shards,
    so the engine may build the model on the meta device first (default: built on the host)."""

    @property
    def has_pretrained(self) -> bool:
        """Whether ``load_pretrained`` has weights to read. Default: no."""
        return False

    @abstractmethod
    def build_model(self, ctx) -> torch.nn.Module:
        """The whole model, freshly initialised from the current RNG (the engine may build it under
        ``torch.device("meta")`` and materialise it after sharding)."""

    def load_pretrained(self, model: torch.nn.Module) -> None:
        """Fill ``model`` (possibly FSDP-sharded: each rank fills what it holds) with the task's
        pretrained weights. Called only when ``has_pretrained`` and the run does not resume."""
        raise NotImplementedError(f"task {type(self).__name__}: has_pretrained but no load_pretrained")

    def compile_default(self, ctx) -> bool:
        """Whether to compile when ``train.compile`` is null. Default: on CUDA."""
        return ctx.device.type == "cuda"
