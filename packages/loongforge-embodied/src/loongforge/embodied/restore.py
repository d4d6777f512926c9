"""Rebuild a trained policy (config + weights, LoRA adapters included) from a checkpoint, on one process."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch.nn as nn

from loongforge.core.checkpoint import Checkpoint, checkpoint_root
from loongforge.core.checkpoint_owner import check_checkpoint_command
from loongforge.core.config import load_saved_config
from loongforge.core.lora import LoRAConfig, apply_lora, lora_record
from loongforge.core.models import get_model_spec
from loongforge.core.training.torch_checkpoint import load_model
from loongforge.embodied.config import EmbodiedConfig, load_train_config


def config_from_checkpoint(ckpt: Checkpoint, overrides: Sequence[str] = ()) -> EmbodiedConfig:
    """The checkpoint's run config (from its manifest) with ``key=value`` overrides; another
    modality's checkpoint is refused naming the command it is for."""
    check_checkpoint_command(ckpt.manifest, "lf-embodied", ckpt.directory)
    return load_saved_config(ckpt.manifest["config"], load_train_config, overrides,
                             source=f"the config of checkpoint {ckpt.directory}")


def restore_policy(path: str | Path, overrides: Sequence[str] = ()) -> tuple[nn.Module, EmbodiedConfig, Checkpoint]:
    """The policy saved at ``path`` (a run directory, checkpoint root or step directory), its run
    config and the checkpoint."""
    ckpt = Checkpoint(checkpoint_root(path))
    cfg = config_from_checkpoint(ckpt, overrides)
    policy = get_model_spec(cfg.model.family).build(cfg.model)
    lora = lora_record(ckpt.manifest)
    if lora:  # a LoRA run: the same adapted layers (merge_lora folds them for an export)
        apply_lora(policy, LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], target_modules=lora["target_modules"]))
    load_model(policy, ckpt)
    return policy, cfg, ckpt
