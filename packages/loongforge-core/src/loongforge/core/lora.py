"""LoRA for the PyTorch-native engine's models (``lora.rank > 0``), written once for every modality.

``apply_lora(model, LoRAConfig(rank=8, alpha=16, target_modules=[...]), seed)`` replaces every
``nn.Linear`` whose qualified name matches a target (``loongforge.core.training.schema.LoRAConfig``:
a name suffix, or ``re:REGEX`` matched in full) by a ``LoRALinear``: the same ``weight``/``bias``
parameters (so the state-dict names of the base model are unchanged) plus two bias-free linears,
``lora_A`` (``[rank, in]``, Kaiming-uniform like torch's ``nn.Linear`` and PEFT) and ``lora_B``
(``[out, rank]``, zero), computing ``W x + b + (alpha / rank) * B A dropout(x)``. Every other
parameter is frozen; an adapter is trainable when the layer it adapts was (a model keeps frozen
what a run does not train: Wan 2.2's other expert, the parts of a policy the loss never reaches).
``A`` is drawn from a generator seeded by the run seed and the layer's name, so every layout and
every rank starts from the same adapters, on a model built on the host or on the meta device
(``init_adapters`` fills them after FSDP2 has sharded the model).

A model whose forward reads a linear layer's ``weight`` directly (a fused QKV GEMM, an FP8 GEMM,
a fused feed-forward) adds ``lora_delta(layer, x)`` itself; the torch engine refuses a step in
which a trainable adapter got no gradient, which is how a forward that skips an adapter shows.

Checkpoints of the loop keep the base weights under their own names plus
``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight`` (and the run's ``lora`` group in the
manifest), so resuming is exact and exports need no model:

- ``merge_state`` folds ``W + (alpha / rank) * B @ A`` into plain weights (the modality's
  converters then write an ordinary model); ``merge_lora`` does the same to a module in place;
- ``export_peft_adapter`` writes the adapters alone in PEFT's format (``adapter_config.json`` +
  ``adapter_model.safetensors``) under the target library's module names, given the modality's
  ``AdapterLayout`` (its name mapping, the key prefix the library loads, diffusers' metadata);
  a layer fused here and split there (a ``RowSplit``: megatron's ``linear_qkv`` is q/k/v_proj)
  becomes one adapter per part, ``A`` shared and ``B``'s rows split as the weight's.
  ``export_checkpoint_adapter`` reads the checkpoints of both engines (the megatron engine's
  through its family's HF mapping, ``transformers_layout`` naming them as transformers does).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from loongforge.core.training.schema import LoRAConfig

__all__ = [
    "AdapterLayout",
    "LoRAConfig",
    "LoRALinear",
    "RowSplit",
    "adapter_modules",
    "adapter_renames",
    "apply_lora",
    "export_checkpoint_adapter",
    "export_peft_adapter",
    "initial_a",
    "init_adapters",
    "is_adapter_key",
    "lora_delta",
    "lora_record",
    "matches",
    "merge_lora",
    "merge_state",
    "megatron_adapters",
    "merged_weight",
    "one_to_one_names",
    "strip_adapters",
    "transformers_layout",
]

LORA_A, LORA_B = "lora_A", "lora_B"
ADAPTER_SUFFIXES = (f".{LORA_A}.weight", f".{LORA_B}.weight")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers reads the LoRA config from this header entry
UNNAMED = "fused or transformed there"  # why an AdapterLayout names no layer, unless it says


# -- matching and initialisation ---------------------------------------------------------------
def matches(name: str, targets: Iterable[str]) -> bool:
    """Whether the layer ``name`` is one of ``lora.target_modules``: the name itself or a dotted
    suffix of it (``to_q``, ``attn1.to_q``), or ``re:REGEX`` matching the whole name."""
    for target in targets:
        if target.startswith("re:"):
            if re.fullmatch(target[3:], name):
                return True
        elif name == target or name.endswith("." + target):
            return True
    return False


def initial_a(name: str, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """Kaiming-uniform ``A`` (``a = sqrt(5)``, as torch's ``nn.Linear`` and PEFT: bound
    ``1 / sqrt(fan_in)``), whole, from a generator seeded by the run seed and the layer's name."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g) * 2 - 1) * bound


def is_adapter_key(key: str) -> bool:
    return key.endswith(ADAPTER_SUFFIXES)


def strip_adapters(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict without its adapter tensors (what a base-model loader expects)."""
    return {k: v for k, v in state.items() if not is_adapter_key(k)}


# -- the layer ------------------------------------------------------------------------------
class LoRALinear(nn.Linear):
    """An ``nn.Linear`` plus its low-rank update; made by ``LoRALinear.wrap(linear, ...)``, which
    keeps the linear's own ``weight``/``bias`` parameters (same names, same tensors)."""

    rank: int
    scaling: float

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> LoRALinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        layer.rank, layer.scaling = rank, alpha / rank
        layer.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
        layer.lora_A = nn.Linear(linear.in_features, rank, bias=False, **factory)
        layer.lora_B = nn.Linear(rank, linear.out_features, bias=False, **factory)
        return layer

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``(alpha / rank) * B A dropout(x)``."""
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.delta(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def lora_delta(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The adapter's update of ``layer`` for input ``x``, or None when ``layer`` has no adapter;
    for forwards that use a linear layer's weight without calling the layer."""
    return layer.delta(x) if isinstance(layer, LoRALinear) else None


@torch.no_grad()
def _fill(param: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy the rows of ``whole`` that ``param`` (a whole tensor or an FSDP2 shard) holds."""
    from loongforge.core.training.sharding import local, region

    offset, shape = region(param)
    if shape and shape[0] == 0:
        return
    local(param).copy_(whole[offset[0]:offset[0] + shape[0]].to(local(param).dtype))


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Initial adapters of every ``LoRALinear`` of ``model``: ``A`` from the seeded generator of
    its name, ``B`` zero; whole tensors or FSDP2 shards (each rank fills the rows it holds)."""
    for name, layer in model.named_modules():
        if isinstance(layer, LoRALinear):
            _fill(layer.lora_A.weight, initial_a(name, layer.rank, layer.in_features, seed))
            _fill(layer.lora_B.weight, torch.zeros(layer.out_features, layer.rank))


def apply_lora(model: nn.Module, lora: LoRAConfig, seed: int = 0) -> list[str]:
    """Wrap the targeted ``nn.Linear`` layers of ``model`` in place and freeze every other
    parameter; returns the adapted layers' names. On the meta device the adapters stay
    uninitialised (``init_adapters`` after materialising)."""
    from loongforge.core.config import ConfigError

    linears, adapted, trainable = [], [], []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:  # subclasses may use their weight directly (nn.MultiheadAttention)
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            linears.append(name)
            if not matches(name, lora.target_modules):
                continue
            was_trained = child.weight.requires_grad
            layer = LoRALinear.wrap(child, lora.rank, lora.alpha, lora.dropout)
            setattr(parent, child_name, layer)
            adapted.append(name)
            if was_trained:
                trainable.append(layer)
    if not adapted:
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ConfigError(f"lora.target_modules={list(lora.target_modules)} match no linear layer; the model's are "
                         f"{suffixes} (e.g. {linears[:3]})")
    if not trainable:
        raise ConfigError(f"lora.target_modules={list(lora.target_modules)} adapt only layers this run keeps frozen "
                         f"({adapted[:3]}...)")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in trainable:
        layer.lora_A.weight.requires_grad_(True)
        layer.lora_B.weight.requires_grad_(True)
    if not any(p.is_meta for p in model.parameters()):
        init_adapters(model, seed)
    return adapted


# -- merging --------------------------------------------------------------------------------
def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A``, computed in fp32, in ``W``'s dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter of ``model`` into its layer's weight and put a plain ``nn.Linear``
    (the same parameters) back in its place; returns the merged layers' names."""
    merged = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, LoRALinear):
                continue
            child.weight.copy_(merged_weight(child.weight, child.lora_A.weight, child.lora_B.weight, child.scaling))
            plain = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(plain)
            plain.in_features, plain.out_features = child.in_features, child.out_features
            plain.weight = child.weight
            plain.register_parameter("bias", child.bias)
            setattr(parent, child_name, plain)
            merged.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return merged


def adapter_modules(keys: Iterable[str]) -> list[str]:
    """The adapted layers of a state dict (names with ``.lora_A.weight``)."""
    suffix = ADAPTER_SUFFIXES[0]
    return sorted(k[: -len(suffix)] for k in keys if k.endswith(suffix))


def merge_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A plain state dict of ``state`` (base weights + adapters): each adapted ``<layer>.weight``
    becomes ``W + scale * B @ A`` and the adapter tensors are dropped."""
    out = strip_adapters(state)
    for layer in adapter_modules(state):
        key = f"{layer}.weight"
        if key not in state:
            raise KeyError(f"adapter {layer}.lora_A.weight has no base weight {key}")
        out[key] = merged_weight(state[key], state[f"{layer}.{LORA_A}.weight"], state[f"{layer}.{LORA_B}.weight"], scale)
    return out


def lora_record(manifest: Mapping) -> dict | None:
    """The ``lora`` group a checkpoint was trained with (rank, alpha, dropout, target_modules),
    or None for a checkpoint without adapters."""
    record = manifest.get("lora") or (manifest.get("config") or {}).get("lora") or {}
    return dict(record) if record.get("rank") else None


# -- export in PEFT's format ------------------------------------------------------------------
@dataclass(frozen=True)
class RowSplit:
    """One layer of ours that is several of the target library's (megatron's fused ``linear_qkv``
    is q/k/v_proj, its SwiGLU ``linear_fc1`` gate/up_proj): their weight names, and ``split(t)``,
    which splits a tensor with the fused layer's rows into theirs, in ``names`` order. Every
    output row reads the same input, so the adapter is one per name with ``A`` shared and
    ``B``'s rows split as the weight's are."""

    names: tuple[str, ...]
    split: Callable[[torch.Tensor], list[torch.Tensor]]


def adapter_renames(bound) -> dict[str, str | RowSplit]:
    """``{LoongForge weight name: target-library weight name or RowSplit}`` of a bound HF mapping:
    its one-to-one renames, and its fused layers whose transform only splits rows
    (``Transform.splits_rows``, e.g. ``fuse_qkv``, ``fuse_gate_up``), split by that transform."""
    from loongforge.core.hf_mapping.transforms import Identity

    out: dict[str, str | RowSplit] = {}
    for c in bound.conversions:
        if len(c.lf) != 1:
            continue
        if isinstance(c.transform, Identity) and len(c.hf) == 1:
            out[c.lf[0]] = c.hf[0]
        elif c.transform.splits_rows:
            out[c.lf[0]] = RowSplit(tuple(c.hf), partial(_to_hf, c))
    return out


def _to_hf(conversion, t: torch.Tensor) -> list[torch.Tensor]:
    return conversion.to_hf([t])


def one_to_one_names(bound) -> dict[str, str]:
    """``{LoongForge name: target-library name}`` of a bound HF mapping's renames (identity
    conversions of one tensor each: what an adapter's layer can be named through)."""
    return {ours: theirs for ours, theirs in adapter_renames(bound).items() if isinstance(theirs, str)}


@dataclass(frozen=True)
class AdapterLayout:
    """Where the adapters of one model (or one part of it) go, for one target library.

    ``prefix``: the part's prefix in the checkpoint's names (``transformer.`` for Wan's first
    expert); ``rename(names)``: ``{our weight name: library weight name}`` (or a ``RowSplit`` of a
    layer that is several there) for the part's weight names (without the prefix); a layer it
    leaves out cannot be exported, ``unnamed`` says why; ``directory``: under the export's OUT
    (``""``: OUT itself);
    ``key_prefix``: what the library's loader expects in front of its module names in
    ``adapter_model.safetensors`` (``transformer.`` for diffusers, ``base_model.model.`` for a
    ``PeftModel``); ``metadata_prefix``: diffusers' loaders read the LoRA config from the file's
    header, keys prefixed with the component (``transformer``), None for none."""

    prefix: str
    rename: Callable[[list[str]], Mapping[str, str | RowSplit]]
    library: str
    directory: str = ""
    key_prefix: str = ""
    metadata_prefix: str | None = None
    base_model: str | None = None
    unnamed: str = UNNAMED


def _minimal_targets(adapted: list[str], universe: Iterable[str]) -> list[str]:
    """The shortest dotted suffixes that select exactly the ``adapted`` modules among ``universe``
    (PEFT's list matching: a module whose name is the entry or ends with ``.`` + it)."""
    adapted_set, universe = set(adapted), set(universe) | set(adapted)
    out = set()
    for name in adapted:
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if suffix[0].isdigit() and k < len(parts):  # "0" alone reads badly: "to_out.0"
                continue
            if all(u in adapted_set for u in universe if u == suffix or u.endswith("." + suffix)):
                out.add(suffix)
                break
    return sorted(out)


def transformers_layout(manifest: Mapping, *, leave_out: Callable[[str], bool] | None = None, unnamed: str = UNNAMED,
                        module_name: Callable[[str], str] | None = None) -> AdapterLayout:
    """The adapters of a megatron family's checkpoint (``manifest``: its manifest) under the
    names of its transformers model (the family's HF mapping, fused layers split by
    ``adapter_renames``), for ``PeftModel.from_pretrained`` of that model; ``leave_out(name)``:
    layers (LoongForge weight names) transformers has no module for, ``unnamed`` says why;
    ``module_name(name)``: the model's module path of an HF checkpoint name where the two differ
    (transformers' Qwen2.5-VL saves ``model.layers.0...`` from ``model.language_model.layers.0...``)."""
    from loongforge.core.hf_mapping.checkpoint_binding import bind_checkpoint

    _, adapter, cfg, bound = bind_checkpoint(dict(manifest), "the checkpoint's manifest.json")
    architecture = adapter.config_to_hf(cfg)["architectures"][0]  # refuses a model transformers cannot express
    renames = {ours: theirs for ours, theirs in adapter_renames(bound).items() if not (leave_out and leave_out(ours))}
    if module_name is not None:
        renames = {ours: module_name(theirs) if isinstance(theirs, str)
                   else RowSplit(tuple(module_name(n) for n in theirs.names), theirs.split)
                   for ours, theirs in renames.items()}
    return AdapterLayout(prefix="", rename=lambda weights: {w: renames[w] for w in weights if w in renames},
                         library=f"transformers {architecture}", key_prefix="base_model.model.",
                         unnamed=unnamed)


def _weight_names(target: str | RowSplit) -> tuple[str, ...]:
    return (target,) if isinstance(target, str) else target.names


def _peft_config(record: Mapping, targets: list[str], base_model: str | None) -> dict:
    return {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model, "revision": None,
        "inference_mode": True, "r": int(record["rank"]), "lora_alpha": float(record["alpha"]),
        "lora_dropout": float(record.get("dropout", 0.0)), "target_modules": targets, "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def export_peft_adapter(names: Iterable[str], get: Callable[[str], torch.Tensor], record: Mapping, out: str | Path,
                        layouts: Iterable[AdapterLayout], dtype: torch.dtype | None = None) -> list[Path]:
    """Write the adapters of a LoRA model (``names``: its state-dict names, base weights and
    adapters; ``get(name)``: a tensor, read only for adapters) in PEFT's format, one directory per
    layout that has adapters: the ``adapter_config.json`` of the run's ``lora`` group (``record``)
    with ``target_modules`` the shortest suffixes that name exactly the adapted layers in the
    library's names, and ``adapter_model.safetensors`` with ``<key_prefix><library layer>.lora_A.weight``
    and ``lora_B.weight``. Returns the directories written."""
    from safetensors.torch import save_file

    from loongforge.core.errors import OutputExistsError
    from loongforge.core.hf_mapping.transforms import MappingError

    out, names = Path(out), list(names)
    if out.exists():
        raise OutputExistsError(f"{out} exists; the adapter export writes a new directory")
    jobs = []
    for layout in layouts:
        part = [k[len(layout.prefix):] for k in names if k.startswith(layout.prefix)]
        layers = adapter_modules(part)
        if not layers:
            continue
        renamed = layout.rename([k for k in part if k.endswith(".weight") and not is_adapter_key(k)])
        missing = [layer for layer in layers if f"{layer}.weight" not in renamed]
        if missing:
            raise MappingError(f"adapters on {missing[:3]}: the {layout.library} layout has no name for these "
                               f"layers ({layout.unnamed}); export the merged model instead")
        universe = [n[: -len(".weight")] for target in renamed.values() for n in _weight_names(target)
                    if n.endswith(".weight")]
        tensors, adapted = {}, []
        for layer in layers:
            target = renamed[f"{layer}.weight"]
            a, b = (get(f"{layout.prefix}{layer}.{factor}.weight") for factor in (LORA_A, LORA_B))
            parts = [b] if isinstance(target, str) else target.split(b)
            for name, b_part in zip(_weight_names(target), parts, strict=True):
                name = name[: -len(".weight")]
                adapted.append(name)
                for factor, t in ((LORA_A, a), (LORA_B, b_part)):  # (A is cloned: one storage per entry)
                    tensors[f"{layout.key_prefix}{name}.{factor}.weight"] = (t.to(dtype) if dtype else t).clone()
        jobs.append((layout, _minimal_targets(sorted(adapted), universe), tensors))
    if not jobs:
        raise MappingError("no adapter tensors to export (a LoRA checkpoint is saved by a run with lora.rank > 0)")
    written = []
    for layout, targets, tensors in jobs:
        directory = out / layout.directory if layout.directory else out
        directory.mkdir(parents=True, exist_ok=True)
        config = _peft_config(record, targets, layout.base_model)
        (directory / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        metadata = {"format": "pt"}
        if layout.metadata_prefix is not None:
            keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_dora", "use_rslora")
            metadata[DIFFUSERS_METADATA_KEY] = json.dumps(
                {f"{layout.metadata_prefix}.{k}": config[k] for k in keys}, sort_keys=True)
        save_file(tensors, str(directory / PEFT_WEIGHTS), metadata=metadata)
        written.append(directory)
    return written


# -- from a checkpoint of the loop -------------------------------------------------------------
def export_checkpoint_adapter(source: str | Path, out: str | Path,
                              layouts: Callable[[dict, list[str]], list[AdapterLayout]], *, ema: bool = False,
                              dtype: torch.dtype | None = None, command: str | None = None) -> list[Path]:
    """``lf-X convert lora-to-peft``: the adapters of a LoRA checkpoint of the loop (a run
    directory, checkpoint root or step directory) in PEFT's format; ``layouts(manifest, names)``
    is the modality's naming. ``ema``: the EMA of the adapters (a run with ``ema.decay > 0``).
    ``command``: the ``lf-*`` command whose checkpoints ``layouts`` names (another's are refused)."""
    from loongforge.core.checkpoint import Checkpoint, CheckpointReadError, checkpoint_root

    ckpt = Checkpoint(checkpoint_root(source))
    if command is not None:
        from loongforge.core.checkpoint_owner import check_checkpoint_command

        check_checkpoint_command(ckpt.manifest, command, ckpt.directory)
    record = lora_record(ckpt.manifest)
    if record is None:
        raise CheckpointReadError(f"{ckpt.directory}: not a LoRA checkpoint (trained with lora.rank=0); "
                                  "export the whole model instead")
    if ema and not ckpt.manifest.get("ema"):
        raise CheckpointReadError(f"{ckpt.directory}: the checkpoint has no EMA weights (trained with ema.decay=0)")
    if ckpt.manifest.get("engine") == "megatron":
        names, get = _megatron_state(ckpt)
    else:
        keys = set(ckpt.reader.keys())
        names = sorted(k[len("model."):] for k in keys if k.startswith("model."))

        def get(name: str) -> torch.Tensor:
            return ckpt.tensor(f"ema.{name}" if ema and f"ema.{name}" in keys else f"model.{name}")

    return export_peft_adapter(names, get, record, out, layouts(ckpt.manifest, names), dtype)


def _megatron_state(ckpt) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """A megatron-engine LoRA checkpoint as per-layer state-dict names (the family's HF mapping's
    LoongForge names, global layer and expert indices, adapters as ``<layer>.lora_A.weight``) and
    their reader."""
    from loongforge.core.hf_mapping.checkpoint_binding import OPTIMIZER_PREFIX, bind_checkpoint, read_at

    _, _, _, bound = bind_checkpoint(ckpt.manifest, ckpt.directory / "manifest.json")
    keys = {k for k in ckpt.reader.keys() if not k.startswith(OPTIMIZER_PREFIX)}
    where = {name: bound.location(name) for name in bound.lf_names}
    for name, pair in megatron_adapters(bound, keys, ckpt.directory).items():
        for factor, loc in zip((LORA_A, LORA_B), pair):
            where[f"{name[: -len('weight')]}{factor}.weight"] = loc
    return sorted(where), lambda name: read_at(ckpt, where[name])


def megatron_adapters(bound, keys: Iterable[str], source) -> dict:
    """``{LoongForge weight name: (Location of A, Location of B)}`` of the adapters among a
    megatron checkpoint's sharded ``keys`` (``bound``: its family's bound HF mapping). The
    megatron LoRA layers keep them beside the weight (``decoder.layers.mlp.linear_fc1.lora_A``,
    layers and experts stacked as the weight is); one beside no weight the mapping holds is a
    ``MappingError`` naming it (``source``: the checkpoint, for the message)."""
    from loongforge.core.hf_mapping.table import Location
    from loongforge.core.hf_mapping.transforms import MappingError

    keys = set(keys)
    out: dict = {}
    placed: set[str] = set()
    for name in bound.lf_names:
        loc = bound.location(name)
        if not (name.endswith(".weight") and loc.key.endswith(".weight")):
            continue
        pair = tuple(Location(f"{loc.key[: -len('weight')]}{factor}", loc.offsets, loc.sizes) for factor in (LORA_A, LORA_B))
        if pair[0].key in keys or pair[1].key in keys:
            out[name] = pair
            placed.update(p.key for p in pair)
    stray = sorted(k for k in keys if k.endswith((f".{LORA_A}", f".{LORA_B}")) and k not in placed)
    if stray:
        raise MappingError(f"{source}: adapter tensors {stray[:3]} adapt layers the family's Hugging Face mapping does "
                           "not hold")
    return out
