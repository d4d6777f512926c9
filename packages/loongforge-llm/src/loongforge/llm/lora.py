"""LoRA: low-rank adapters on megatron-core's tensor-parallel linear layers, base weights frozen.

``apply_lora(model, LoRAConfig(rank=8, alpha=16, target_modules=[...]))`` wraps every
``ColumnParallelLinear``/``RowParallelLinear`` whose qualified name ends with a target
(``linear_qkv``, ``self_attention.linear_proj``, ``mlp.linear_fc1`` ...; or matches ``re:REGEX``)
so that it computes
``W x + (alpha / rank) * B A x`` (A ``[rank, in]`` random, B ``[out, rank]`` zero, so training
starts from the base model), and freezes every other parameter.

The adapters are sharded like the layer they adapt, so TP changes neither the result nor the
gradients:

- column-parallel ``W`` (output split over TP): ``B`` is split by rows with ``W``, ``A`` is
  whole on every rank. ``A x`` is made whole on every TP rank before ``B`` (without sequence
  parallelism by an all-reduce of its gradient, with it by an all-gather of the rank-r
  activations over the sequence; ``A``'s gradient is then summed over TP by megatron's
  finalize_model_grads, like a sequence-parallel norm's);
- row-parallel ``W`` (input split over TP): ``A`` is split by columns with ``W``, ``B`` is whole;
  the partial ``A x`` is all-reduced (reduce-scattered over the sequence under SP) before ``B``.

``A`` is drawn from a generator seeded by the run seed and the layer's layout-independent name
(global layer and expert indices), whole, then sliced: every TP/PP/EP layout starts from the
same adapters. Checkpoints keep the base weights under their own names (a LoRA checkpoint is a
base checkpoint plus ``<layer>.lora_A``/``lora_B``; SwiGLU ``linear_fc1`` adapters are stored in
its ``[gate; up]`` layout), so ``merge_checkpoint`` can fold ``W + scale * B @ A`` into a
plain checkpoint (to train on from) from the stored global tensors without building a model;
``lf-llm convert lf-to-hf`` reads a LoRA checkpoint merged by the same fold, and
``lf-llm convert lora-to-peft`` writes the adapters alone in PEFT's format
(``loongforge.core.lora.export_checkpoint_adapter``, transformers' names).

Routed experts can be adapted when the expert tensor-parallel size is 1 (with EP any size).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

# the config group, the target matching, A's initialisation and the merge are the shared ones of
# loongforge.core.lora (the PyTorch-native engine's LoRA); this module adds megatron's TP layers
from loongforge.core.lora import initial_a as _initial_a
from loongforge.core.lora import matches, merged_weight
from loongforge.core.training.schema import LoRAConfig

DEFAULT_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_A, LORA_B = "lora_A", "lora_B"
__all__ = ["DEFAULT_TARGETS", "LoRAConfig", "LoRALinear", "apply_lora", "is_adapter",
           "load_base_weights", "matches", "merge_checkpoint", "merged_weight"]


def _mark_tensor_parallel(param: torch.nn.Parameter, dim: int) -> None:
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1


class LoRALinear(torch.nn.Module):
    """A megatron Column/RowParallelLinear plus its low-rank update (see the module doc).

    The wrapped layer is kept out of the module tree and its parameters are registered here
    under their own names, so state dicts, sharded checkpoints and the HF mappings see the base
    layer's names unchanged; attributes megatron reads from the layer are forwarded to it.
    """

    def __init__(self, base: torch.nn.Module, *, column: bool, glu: bool, lora: LoRAConfig, full_a: torch.Tensor):
        super().__init__()
        self.__dict__["base"] = base  # not a submodule, see the class doc
        for name, p in base.named_parameters(recurse=False):
            self._parameters[name] = p  # (register_parameter would see the forwarded base attribute)
        self.column, self.glu, self.scale = column, glu, lora.scale
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        self.tp_size, tp_rank = base.tp_group.size(), base.tp_group.rank()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not base.is_expert
        out_local, in_local = base.weight.shape
        dtype, device = base.weight.dtype, base.weight.device
        if column:
            a = full_a
            b = torch.zeros(out_local, lora.rank, dtype=dtype, device=device)
        else:
            a = full_a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
            b = torch.zeros(out_local, lora.rank, dtype=dtype, device=device)
        self.lora_A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.lora_B = torch.nn.Parameter(b)
        split, whole = (self.lora_B, self.lora_A) if column else (self.lora_A, self.lora_B)
        _mark_tensor_parallel(split, 0 if column else 1)
        # the whole factor's gradient is partial per TP rank under SP (summed by finalize_model_grads)
        whole.sequence_parallel = self.sequence_parallel
        for p in (self.lora_A, self.lora_B):
            if hasattr(base.weight, "allreduce"):
                p.allreduce = base.weight.allreduce  # experts: reduced over expert-DP, as their weights

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["base"], name)

    def train(self, mode: bool = True):
        self.base.train(mode)
        return super().train(mode)

    def get_extra_state(self):
        return self.base.get_extra_state()

    def set_extra_state(self, state):
        self.base.set_extra_state(state)

    # -- compute ----------------------------------------------------------------------------
    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        group, comm = self.base.tp_group, self.tp_size > 1 and not self.base.explicit_expert_comm
        if self.column:
            h = F.linear(self.dropout(x), self.lora_A)
            if comm:
                h = (mappings.gather_from_sequence_parallel_region(h, group=group) if self.sequence_parallel
                     else mappings.copy_to_tensor_model_parallel_region(h, group=group))
            delta = F.linear(h, self.lora_B)
            if self.base.gather_output and comm:
                delta = mappings.gather_from_tensor_model_parallel_region(delta, group=group)
            return delta * self.scale
        if not self.base.input_is_parallel and comm:
            x = mappings.scatter_to_tensor_model_parallel_region(x, group=group)
        h = F.linear(self.dropout(x), self.lora_A)
        if comm:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h, group=group))
        return F.linear(h, self.lora_B) * self.scale

    def forward(self, x, *args, **kwargs):
        out, bias = self.base(x, *args, **kwargs)
        return out + self._delta(x).to(out.dtype), bias

    # -- checkpoints ------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = {LORA_B: 0} if self.column else {LORA_A: 1}
        adapters = make_sharded_tensors_for_checkpoint({LORA_A: self.lora_A, LORA_B: self.lora_B}, prefix, axis,
                                                       sharded_offsets, tp_group=self.base.tp_group,
                                                       dp_cp_group=metadata["dp_cp_group"])
        if self.glu:
            key = f"{prefix}{LORA_B}"
            adapters[key] = apply_swiglu_sharded_factory(adapters[key], sharded_offsets,
                                                         metadata.get("singleton_local_shards", False),
                                                         tp_group=self.base.tp_group, dp_group=metadata["dp_cp_group"])
        out.update(adapters)
        return out


# -- applying ---------------------------------------------------------------------------------
def _global_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(module) -> name`` with global layer (PP) and expert (EP) indices, the same under
    every layout."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    renames: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer) and re.search(r"layers\.\d+$", name):
            renames[name] = re.sub(r"\d+$", str(module.layer_number - 1), name)
        elif isinstance(module, SequentialMLP):
            offset = module.ep_group.rank() * module.num_local_experts
            for i in range(module.num_local_experts):
                renames[f"{name}.local_experts.{i}"] = f"{name}.local_experts.{offset + i}"
    out = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        for k in range(len(parts), 0, -1):  # innermost renamed ancestor first
            head = ".".join(parts[:k])
            if head in renames:
                name = renames[head] + name[len(head):]
                parts = name.split(".")
        out[id(module)] = name
    return out


def apply_lora(model: torch.nn.Module, lora: LoRAConfig, seed: int = 0) -> list[str]:
    """Wrap the targeted linear layers of ``model`` in place and freeze everything else;
    returns the adapted layers' global names. Targets that reach no layer, or a routed expert split
    over expert tensor parallelism, are a ``ConfigError`` (one error line on every rank)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from loongforge.core.config import ConfigError

    names = _global_names(model)
    linears, adapted = [], []
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                continue
            name = names[id(child)]
            linears.append(name)
            if not matches(name, lora.target_modules):
                continue
            if child.is_expert and child.tp_group.size() > 1:
                raise ConfigError(f"lora.target_modules={lora.target_modules} adapt routed expert {name}, which is split over "
                                 f"expert tensor parallelism ({child.tp_group.size()} ranks, the TP size); adapt the "
                                 "experts with parallel.tp=1 (any parallel.ep) or leave them out of the targets")
            column = isinstance(child, ColumnParallelLinear)
            out_local, in_local = child.weight.shape
            fan_in = in_local if column else in_local * child.tp_group.size()
            glu = column and child_name == "linear_fc1" and bool(child.config.gated_linear_unit)
            setattr(parent, child_name, LoRALinear(child, column=column, glu=glu, lora=lora,
                                                   full_a=_initial_a(name, lora.rank, fan_in, seed)))
            adapted.append(name)
    if not adapted:
        raise ConfigError(f"lora.target_modules={lora.target_modules} match no linear layer; the model's are "
                         f"{sorted({n.split('.')[-1] for n in linears})} (e.g. {linears[:3]})")
    for name, p in model.named_parameters():
        p.requires_grad = name.endswith((LORA_A, LORA_B))
    return adapted


def is_adapter(name: str) -> bool:
    return name.endswith((f".{LORA_A}", f".{LORA_B}"))


def load_base_weights(model: torch.nn.Module, path: str | Path, model_config: dict) -> None:
    """Load a checkpoint's weights (a base model: no adapters) into ``model`` before the
    adapters are added (``lora.base``); its model config must be ``model_config``."""
    from loongforge.core.checkpoint import Checkpoint, CheckpointReadError
    from loongforge.core.checkpoint.sharded import load_into

    ckpt = Checkpoint(path)
    saved = ckpt.manifest.get("model_config", {})
    diff = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
    if diff:
        raise CheckpointReadError(f"lora.base={path}: the model config differs in " + ", ".join(
            f"model.{k} (checkpoint {saved.get(k)!r}, config {model_config.get(k)!r})" for k in diff))
    objects = {}
    for rank in range(int(ckpt.manifest.get("world_size", 1))):
        objects.update(ckpt.objects(rank).get("sharded_objects", {}))
    model.load_state_dict(load_into(model.sharded_state_dict(), ckpt.reader, objects, {}), strict=True)


# -- export -----------------------------------------------------------------------------------
def _adapted_layers(keys) -> list[str]:
    return sorted(k[: -len(LORA_A) - 1] for k in keys if k.endswith(f".{LORA_A}"))


def _write(source, out: Path, tensors, extra_manifest: dict) -> Path:
    from loongforge.core.checkpoint import Piece
    from loongforge.core.hf_mapping.lf_writer import StreamingCheckpointWriter

    writer = StreamingCheckpointWriter(out, step=0)
    try:
        for key, tensor in tensors:
            writer.add(Piece(key, tuple(tensor.shape), (0,) * tensor.dim(), tensor))
        manifest = {k: source.manifest[k] for k in ("family", "model_config", "tokenizer") if k in source.manifest}
        manifest |= {"layout": {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1, "world_size": 1}, **extra_manifest}
        return writer.finish(manifest)
    except BaseException:
        writer.abort()
        raise


def _lora_record(ckpt) -> dict:
    from loongforge.core.checkpoint import CheckpointReadError

    lora = (ckpt.manifest.get("config") or {}).get("lora") or {}
    if not lora.get("rank") or not _adapted_layers(ckpt.reader.keys()):
        raise CheckpointReadError(f"{ckpt.directory}: not a LoRA checkpoint (no lora config in its manifest or no "
                                  "adapter tensors; LoRA checkpoints are saved by `lf-llm train lora.rank=...`)")
    return lora


def merge_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """A plain weights-only checkpoint of ``checkpoint``'s model with every adapter merged,
    ``W + (alpha / rank) * B @ A`` (``lf-llm convert lf-to-hf`` exports it to HF)."""
    from loongforge.core.checkpoint import Checkpoint

    ckpt = Checkpoint(checkpoint)
    lora = _lora_record(ckpt)
    scale = lora["alpha"] / lora["rank"]
    keys = [k for k in ckpt.reader.keys() if not k.startswith("optimizer.")]
    layers = set(_adapted_layers(keys))

    def tensors():
        for key in keys:
            if is_adapter(key):
                continue
            layer = key[: -len(".weight")] if key.endswith(".weight") else None
            if layer in layers:
                yield key, merged_weight(ckpt.tensor(key), ckpt.tensor(f"{layer}.{LORA_A}"), ckpt.tensor(f"{layer}.{LORA_B}"), scale)
            else:
                yield key, ckpt.tensor(key)

    return _write(ckpt, Path(out), tensors(), {"merged_lora": lora})
