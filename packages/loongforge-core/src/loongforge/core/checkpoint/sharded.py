"""megatron-core sharded state dicts <-> the LoongForge checkpoint format.

megatron describes model and optimizer state as a *sharded state dict*: ``ShardedTensor``s
(regions of global tensors, independent of TP/PP/EP/DP), ``ShardedObject``s (opaque per-shard
objects) and plain "common" values, with factories for fused tensors (SwiGLU ``linear_fc1``).
We use megatron's own pre/post-processing (factories, merges) and store the regions as
safetensors pieces, the objects and common values as ``torch.save`` files; reading a region
written under another layout reshards.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from loongforge.core.checkpoint.pieces import CheckpointReadError, Piece


class TensorSource(Protocol):
    """What ``load_into`` reads regions from: a checkpoint's ``PieceReader``, or an HF directory
    seen as one (``hf_mapping.online.HFPieceReader``)."""

    directory: Path

    def keys(self) -> Iterable[str]: ...

    def global_shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, offset: tuple[int, ...] | None = None,
             shape: tuple[int, ...] | None = None) -> torch.Tensor: ...


def _is_primary(replica_id) -> bool:
    return all(r == 0 for r in replica_id) if isinstance(replica_id, tuple) else replica_id == 0


# The fp32 master weights are named differently by megatron's two optimizers, and a plain fp32
# optimizer keeps none (its master weights are the model weights). A load reads the first of
# these names present in the checkpoint.
MASTER_WEIGHT_ALIASES = {
    "optimizer.state.param.": ("optimizer.state.fp32_param.", ""),
    "optimizer.state.fp32_param.": ("optimizer.state.param.", ""),
}


def stored_key(key: str, reader: TensorSource) -> str:
    if key in reader.keys():
        return key
    for prefix, alternatives in MASTER_WEIGHT_ALIASES.items():
        if key.startswith(prefix):
            for alt in alternatives:
                candidate = alt + key[len(prefix):]
                if candidate in reader.keys():
                    return candidate
    return key


# Module "extra state" (megatron/TE linear layers: FP8 scaling metadata, None without FP8) is
# optional: a checkpoint without it, such as one converted from Hugging Face, still loads.
EXTRA_STATE = "._extra_state"


def _region(sh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape)


def flatten_for_save(sharded_state_dict: dict) -> tuple[list[Piece], dict, dict]:
    """Split into ``(primary tensor pieces, primary sharded objects by unique key, common)``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    sharded_part, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    pieces, objects = [], {}
    for sh in nested_values(sharded_part):
        if isinstance(sh, ShardedTensor):
            if not _is_primary(sh.replica_id):
                continue
            if sh.flattened_range is not None:
                raise ValueError(f"{sh.key}: flattened shards are not supported; save the optimizer fully reshardable")
            offset, local = _region(sh)
            pieces.append(Piece(sh.key, tuple(sh.global_shape), offset, sh.data.detach().reshape(local)))
        elif isinstance(sh, ShardedObject):
            if _is_primary(sh.replica_id):
                objects[sh.unique_key] = sh.data
    return pieces, objects, common


def load_into(sharded_state_dict: dict, reader: TensorSource, objects: dict, common: dict) -> dict:
    """The plain state dict for ``sharded_state_dict`` (built with ``is_loading=True``), read
    from the checkpoint; fused tensors are merged back by megatron's factory merges."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    sharded, _ = extract_sharded_base(sharded)  # plain values come from the saved common state

    def fill(sh):
        if isinstance(sh, ShardedTensor):
            key = stored_key(sh.key, reader)
            if key in reader.keys() and tuple(reader.global_shape(key)) != tuple(sh.global_shape):
                raise CheckpointReadError(
                    f"{reader.directory}: tensor {key!r} has global shape {list(reader.global_shape(key))}, the "
                    f"model expects {list(sh.global_shape)} (the model config does not match the checkpoint)"
                )
            offset, local = _region(sh)
            value = reader.read(key, offset, local).reshape(sh.local_shape)
            if sh.flattened_range is not None:
                value = value.flatten()[sh.flattened_range]
            return value.to(dtype=sh.dtype) if sh.dtype is not None else value
        if isinstance(sh, ShardedObject):
            if sh.unique_key not in objects and sh.key.endswith(EXTRA_STATE):
                return None  # none recorded (e.g. converted from HF): the module starts without FP8 metadata
            if sh.unique_key not in objects:
                raise CheckpointReadError(f"{reader.directory}: sharded object {sh.unique_key!r} is not in this checkpoint")
            return objects[sh.unique_key]
        return sh

    dict_list_map_inplace(fill, sharded)
    state = apply_factory_merges(sharded, factories)
    merge(common, state)
    merge(common, nonpersistent)
    return common


def move_tensors(state, device: torch.device):
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    return dict_list_map_inplace(lambda v: v.to(device) if torch.is_tensor(v) else v, state)
