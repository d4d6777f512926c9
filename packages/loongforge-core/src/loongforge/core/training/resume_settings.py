"""What a resume may change in the run's config, and what it may not.

The loop computes each step's LR from the step and the ``train`` group (``schedule.lr_at``) and
clips with ``train.clip_grad``, so a resumed run may change its schedule and AdamW's settings
(``SCHEDULE_KEYS``: a lower LR, a longer schedule, more steps): the weights and the optimizer state are the
checkpoint's, the new values apply from the resumed step on, as if the schedule had always had
them. Each resume is noted in ``RUN_DIR/resumes.jsonl`` with the schedule settings it changed.

The data a step trains on follows from ``train.global_batch_size`` and ``train.seed`` (the order
and the position in it), so those are refused by name (``check_fixed_settings``); so are a model
config, LoRA adapters, a precision recipe or an optimizer kind other than the checkpoint's
(``checkpointing``). The parallel layout may change: checkpoints reshard.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from loongforge.core.checkpoint import CheckpointReadError

SCHEDULE_KEYS = ("lr", "min_lr_ratio", "min_lr", "warmup_steps", "lr_decay_style", "steps", "clip_grad", "weight_decay", "adam_beta1",
                 "adam_beta2", "adam_eps")
FIXED_KEYS = ("global_batch_size", "seed")
RECORD = "resumes.jsonl"


def _train(config: dict) -> dict:
    return config.get("train") or {}


def schedule_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """``{"train.KEY": (checkpoint's value, this run's)}`` of the schedule settings that differ
    between the checkpoint's run config ``saved`` and this run's ``current``."""
    a, b = _train(saved), _train(current)
    return {f"train.{k}": (a[k], b[k]) for k in SCHEDULE_KEYS if k in a and k in b and a[k] != b[k]}


def check_fixed_settings(saved: dict, current: dict, directory: Path) -> None:
    """Refuse a resume from ``directory`` whose config changes a setting the data position depends on."""
    a, b = _train(saved), _train(current)
    changed = [f"train.{k}={b[k]} (the checkpoint's run has {a[k]})" for k in FIXED_KEYS
               if k in a and k in b and a[k] != b[k]]
    if changed:
        raise CheckpointReadError(f"cannot resume from {directory}: {', '.join(changed)}: which samples each step "
                                  f"trains follows from it; resume with the run's value, or start another run "
                                  f"(another log.run_dir)")


def describe_changes(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items())


def record_resume(run_dir: Path, step: int, changes: dict[str, tuple]) -> None:
    """Append this resume to ``RUN_DIR/resumes.jsonl``."""
    entry = {"step": step, "time": time.time(),
             "changed": {key: {"from": old, "to": new} for key, (old, new) in changes.items()}}
    with open(Path(run_dir) / RECORD, "a") as f:
        f.write(json.dumps(entry) + "\n")
