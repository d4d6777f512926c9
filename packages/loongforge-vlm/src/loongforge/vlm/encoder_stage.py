"""The decoupled encoder stage (``parallel.encoder.decoupled: true``): the vision tower runs once
per step, outside megatron's per-micro-batch schedule.

Coupled (the default), each micro-batch's forward on the first pipeline stage encodes its own
images (``VisionLanguageModel.encode_vision``) and its backward runs the tower's backward, so under
pipeline parallelism the first stage's tower work stalls the pipeline once per micro-batch.

Decoupled, the megatron engine calls ``VLMTask.before_schedule`` (the core hook
``loongforge.core.training.task.ScheduledStep``) before the schedule starts. On the stage that holds
the tower (the first; with ``parallel.pp=1`` the only one) ``encode_step``:

1. encodes the images and videos of all the step's micro-batches in one batched forward (the
   tower's own layout: its items shared out over the CP ranks, then across the foundation's TP
   group when the tower is split, as for one micro-batch), keeping the features' autograd graph;
2. hands each micro-batch its rows (in item order, as ``encode_vision`` returns them) as a leaf
   tensor of its own, detached from that graph: the micro-batch's forward only scatters them into
   its placeholder positions (``VisionLanguageModel.forward(vision=...)``) and its backward stops
   at the leaf, whose ``.grad`` is then the rows' gradient;
3. after the schedule's last backward, before megatron's gradient reduction, runs the tower's one
   backward with the leaves' gradients.

The micro-batches' rows are disjoint, so each row's gradient is the one the coupled path hands the
tower, and the tower's parameter gradients are the coupled path's sum over the micro-batches (up
to the order of floating-point additions). The tower's activations of the whole step are held
from the first forward to the end of the schedule.
"""

from __future__ import annotations

import torch

from loongforge.core.training.task import ScheduledStep
from loongforge.vlm.encoders.geometry import patch_counts


def vision_rows(grid_thw: torch.Tensor, merge: int) -> int:
    """How many rows ``encode_vision`` returns for the items of ``grid_thw``."""
    return sum(n // merge for n in patch_counts(grid_thw))


def encode_step(model, micro_batches: list[dict]) -> ScheduledStep | None:
    """The step's micro-batches with their vision rows encoded in one batch (``vision``), and the
    tower's backward to run after the schedule (see the module doc). None where this rank holds
    no tower (a later pipeline stage) or the step has no images or videos."""
    if not model.pre_process:
        return None
    merge = model.cfg.tokens_per_patch_group
    counts = [vision_rows(b["grid_thw"], merge) for b in micro_batches]
    if not sum(counts):
        return None
    features = model.encode_vision(torch.cat([b["pixel_values"] for b in micro_batches]),
                                   torch.cat([b["grid_thw"] for b in micro_batches]))
    leaves = [part.detach().requires_grad_(features.requires_grad) for part in features.split(counts)]

    def backward() -> None:
        if features.requires_grad:  # the same on every rank sharing the items: their gathers' backward
            features.backward(torch.cat([leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                                         for leaf in leaves]))

    return ScheduledStep([{**b, "vision": leaf} for b, leaf in zip(micro_batches, leaves)], backward)
