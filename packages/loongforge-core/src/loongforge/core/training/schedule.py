"""The one learning-rate schedule of the loop: linear warm-up, then cosine/linear decay (or none).

The LR is a pure function of the step, so resuming needs no scheduler state and every engine
(megatron-core's optimizer, torch's AdamW) gets the same rate at the same step.
"""

from __future__ import annotations

import math

from loongforge.core.training.schema import TrainConfig


def lr_at(step: int, train: TrainConfig) -> float:
    """The rate of the update made by 0-based ``step``: ``lr * (step + 1) / warmup_steps`` during
    warm-up (so the first update is never at 0), then from ``lr`` at step ``warmup_steps`` down to
    ``train.final_lr`` at ``train.steps`` (``lr_decay_style``: cosine, linear, or constant at ``lr``)."""
    if train.warmup_steps and step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.lr_decay_style == "constant":
        return train.lr
    span = max(train.steps - train.warmup_steps, 1)
    done = min(max(step - train.warmup_steps, 0) / span, 1.0)
    factor = 0.5 * (1 + math.cos(math.pi * done)) if train.lr_decay_style == "cosine" else 1.0 - done
    return train.final_lr + (train.lr - train.final_lr) * factor
