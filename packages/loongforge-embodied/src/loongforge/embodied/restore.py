"""Rebuild a trained policy (config + weights) from a checkpoint, on one process."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch.nn as nn

from loongforge.core.checkpoint import Checkpoint
from loongforge.embodied.checkpointing import split_state
from loongforge.embodied.config import CONFIG_DIR, TrainConfig
from loongforge.core.config import load_config
from loongforge.embodied.policies.registry import build_policy


def config_from_checkpoint(ckpt: Checkpoint, overrides: Sequence[str] = ()) -> TrainConfig:
    """The checkpoint's training config (from its manifest) with ``key=value`` overrides."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint_config.yaml"
        path.write_text(json.dumps(ckpt.manifest["config"]))  # JSON is YAML
        return load_config(TrainConfig, str(path), overrides, config_dirs=[CONFIG_DIR])


def restore_policy(path: str | Path, overrides: Sequence[str] = ()) -> tuple[nn.Module, TrainConfig, Checkpoint]:
    ckpt = Checkpoint(path)
    cfg = config_from_checkpoint(ckpt, overrides)
    policy = build_policy(cfg.policy)
    model_sd, _ = split_state(ckpt)
    policy.load_state_dict(model_sd, strict=True)
    return policy, cfg, ckpt
