"""A megatron family's LoongForge checkpoint seen through its Hugging Face mapping: the family and
mapping its manifest names, bound to its recorded model config (``bind_checkpoint``), and the tensor
at one mapping location (``read_at``). Shared by the whole-checkpoint conversion
(``hf_mapping.convert``) and the LoRA adapter export (``loongforge.core.lora``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loongforge.core.checkpoint import Checkpoint
from loongforge.core.hf_mapping.adapter import HFAdapter
from loongforge.core.hf_mapping.table import BoundMapping, Location
from loongforge.core.hf_mapping.transforms import MappingError

OPTIMIZER_PREFIX = "optimizer."  # checkpoint keys of the optimizer state (no model weight)


def _adapter_of(family: str, source: Path):
    from loongforge.core.models import get_model_spec

    spec = get_model_spec(family)  # (adapter, spec)
    if not isinstance(spec.hf_adapter, HFAdapter):
        raise MappingError(f"{source}: model family {family!r} has no Hugging Face adapter")
    if spec.engine != "megatron":  # its checkpoint keys are its module's, not megatron's sharded ones
        raise MappingError(f"{source}: model family {family!r} is trained by the {spec.engine} engine; this conversion "
                           f"reads megatron checkpoints (convert it with its own modality's `convert` command)")
    return spec.hf_adapter, spec


def read_at(ckpt: Checkpoint, loc: Location) -> torch.Tensor:
    """The tensor at ``loc`` of a checkpoint: one index of a stacked (per-layer, per-expert) key."""
    shape = ckpt.reader.global_shape(loc.key)
    k = len(loc.sizes)
    if tuple(shape[:k]) != loc.sizes:
        raise MappingError(f"{ckpt.directory}: tensor {loc.key!r} has leading shape {list(shape[:k])}, the model "
                           f"config implies {list(loc.sizes)}")
    return ckpt.reader.read(loc.key, loc.offsets + (0,) * (len(shape) - k), (1,) * k + tuple(shape[k:])).reshape(shape[k:])


def bind_checkpoint(manifest: dict, source: Path | str) -> tuple[str, HFAdapter, Any, BoundMapping]:
    """``(family, HF adapter, model config, bound mapping)`` of the megatron family a checkpoint's
    manifest (``source``, for errors) names, bound to its recorded model config."""
    family = manifest.get("family")
    if not family:
        raise MappingError(f"{source}: no model family recorded")
    adapter, spec = _adapter_of(family, Path(source))
    try:
        cfg = spec.config_class(**manifest.get("model_config", {}))
    except (TypeError, ValueError) as exc:
        raise MappingError(f"{source}: model_config does not fit {spec.config_class.__name__} ({exc})") from exc
    return family, adapter, cfg, adapter.bind(cfg)
