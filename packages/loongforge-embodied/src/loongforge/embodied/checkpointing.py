"""Training state <-> the core checkpoint format (``loongforge.core.checkpoint``).

The full model and optimizer state are gathered to rank 0 with
``torch.distributed.checkpoint.state_dict`` (``full_state_dict=True, cpu_offload=True``), so a
checkpoint does not depend on DDP/FSDP/HSDP or the world size: tensors ``model/<name>`` and
``optim/<param name>/<state>``, optimizer param groups and the full config in the manifest.
Loading hands the full state to every rank, which keeps its own shard. The data position and
the flow-matching noise are functions of the step, so the step is all the loop needs to resume.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from loongforge.core.checkpoint import Checkpoint, latest_checkpoint, save_checkpoint

MODEL, OPTIM = "model/", "optim/"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def find_resume_checkpoint(run_dir: str | Path) -> Path | None:
    return latest_checkpoint(checkpoint_root(run_dir))


def save_training_state(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    manifest: dict,
    *,
    is_main: bool,
    keep_last: int | None,
) -> Path:
    """Every rank calls this; rank 0 writes the gathered full state."""
    model_sd = get_model_state_dict(model, options=FULL)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=FULL)
    tensors: dict[str, torch.Tensor] = {}
    if is_main:
        tensors.update({MODEL + k: v for k, v in model_sd.items()})
        for name, state in optim_sd["state"].items():
            for key, value in state.items():
                tensors[f"{OPTIM}{name}/{key}"] = torch.as_tensor(value)
        manifest = {**manifest, "optimizer_param_groups": _jsonable(optim_sd["param_groups"])}
    return save_checkpoint(
        checkpoint_root(run_dir), step, tensors if is_main else [], manifest=manifest if is_main else None, keep_last=keep_last or None
    )


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.item()
    return obj


def split_state(ckpt: Checkpoint) -> tuple[dict[str, torch.Tensor], dict]:
    """``(model state dict, optimizer state dict)`` of an opened checkpoint, in full form."""
    tensors = ckpt.tensors()
    model_sd = {k[len(MODEL) :]: v for k, v in tensors.items() if k.startswith(MODEL)}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith(OPTIM):
            name, key = k[len(OPTIM) :].rsplit("/", 1)
            state.setdefault(name, {})[key] = v
    groups = ckpt.manifest.get("optimizer_param_groups", [])
    return model_sd, {"state": state, "param_groups": groups}


def load_training_state(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Checkpoint:
    """Load an opened checkpoint's model (and optimizer) state into the wrapped ``model`` on every rank."""
    model_sd, optim_sd = split_state(ckpt)
    if not model_sd:
        raise ValueError(f"checkpoint {ckpt.directory}: holds no model tensors")
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True, strict=True))
    if optimizer is not None:
        if not optim_sd["param_groups"]:
            raise ValueError(f"checkpoint {ckpt.directory}: no optimizer state to resume from")
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
    return ckpt
