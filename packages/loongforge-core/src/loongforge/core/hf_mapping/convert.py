"""Whole-checkpoint conversion between an HF model directory and a LoongForge checkpoint,
streamed one conversion (a few tensors) at a time; no model is built.

``hf_to_lf`` writes ``OUT/step_00000000`` (+ ``OUT/latest``): the model weights as megatron's
sharded-state-dict tensors (per-layer tensors are pieces of the stacked ones), loadable under
any TP/PP layout by the weights-only load path (``checkpoint.load=OUT``). The tokenizer files
of the HF directory are copied into ``tokenizer/`` and named in the manifest. ``lf_to_hf``
reads a checkpoint of a megatron family (converted or saved by training; optimizer state is
skipped; a torch-engine family's checkpoint is refused, its modality converts it) and writes a
directory ``transformers`` loads with ``from_pretrained``; a LoRA checkpoint's adapters are merged
into the weights they adapt (``W + (alpha / rank) * B @ A``, in fp32, stored in ``W``'s dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from loongforge.core.checkpoint import Checkpoint, Piece
from loongforge.core.hf_mapping.adapter import HFAdapter, family_for_architectures
from loongforge.core.hf_mapping.checkpoint_binding import OPTIMIZER_PREFIX, bind_checkpoint, read_at
from loongforge.core.hf_mapping.hf_dir import CONFIG, HFReader, HFWriter, has_tokenizer, tokenizer_files
from loongforge.core.hf_mapping.lf_writer import StreamingCheckpointWriter
from loongforge.core.hf_mapping.table import BoundMapping, summarize_names
from loongforge.core.hf_mapping.transforms import MappingError

TOKENIZER_DIR = "tokenizer"
SINGLE_PROCESS_LAYOUT = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1, "world_size": 1}


@dataclass
class Converted:
    path: Path
    family: str
    model_config: Any
    tensors: int
    tokenizer: Path | None


def _bar(total_bytes: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, disable=not enabled, dynamic_ncols=True)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _model_config_record(cfg) -> dict:
    from loongforge.core.config import to_dict

    return to_dict(cfg)


def _stream_to_lf(reader: HFReader, bound: BoundMapping, writer: StreamingCheckpointWriter, family: str, cfg,
                  dtype, progress: bool) -> tuple[Path, Path | None]:
    source = bound.sources(reader.names())  # a tied copy stands in for a missing original
    total = sum(reader.nbytes(source[n]) for n in bound.hf_names)
    with _bar(total, f"{family} HF -> LoongForge", progress) as bar:
        for conv in bound.conversions:
            outputs = conv.to_lf([reader.get(source[n]) for n in conv.hf])
            for name, tensor in zip(conv.lf, outputs):
                loc = bound.location(name)
                tensor = _cast(tensor, dtype)
                stacked = (1,) * len(loc.sizes) + tuple(tensor.shape)
                writer.add(Piece(loc.key, loc.sizes + tuple(tensor.shape), loc.offsets + (0,) * tensor.dim(), tensor.reshape(stacked)))
            bar.update(sum(reader.nbytes(source[n]) for n in conv.hf))
    files = reader.tokenizer_files()
    for path in files:
        writer.add_file(path, f"{TOKENIZER_DIR}/{path.name}")
    tokenizer = (writer.final_dir / TOKENIZER_DIR).resolve() if has_tokenizer(files) else None
    manifest = {
        "family": family,
        "model_config": _model_config_record(cfg),
        "layout": SINGLE_PROCESS_LAYOUT,
        "consumed_samples": 0,
        "tokenizer": str(tokenizer) if tokenizer else None,
        "converted_from": {"hf_dir": str(reader.directory.resolve()), "architectures": reader.config.get("architectures")},
    }
    return writer.finish(manifest), tokenizer


def hf_to_lf(hf_dir: str | Path, out: str | Path, *, dtype: torch.dtype | None = None, progress: bool = True,
             max_shard_bytes: int = 2 << 30) -> Converted:
    """Convert the HF model directory ``hf_dir`` into the LoongForge checkpoint root ``out``."""
    reader = HFReader(hf_dir)
    family, adapter = family_for_architectures(reader.config.get("architectures"), source=str(reader.directory / CONFIG))
    cfg = adapter.config_from_hf(reader.config)
    bound = adapter.bind(cfg)
    bound.check_hf(reader.names(), source=str(reader.directory))
    writer = StreamingCheckpointWriter(out, step=0, max_shard_bytes=max_shard_bytes)
    try:
        path, tokenizer = _stream_to_lf(reader, bound, writer, family, cfg, dtype, progress)
    except BaseException:
        writer.abort()
        raise
    return Converted(path, family, cfg, len(bound.lf_names), tokenizer)


def _checkpoint_tokenizer(ckpt: Checkpoint) -> list[Path]:
    """The tokenizer files of a checkpoint: its own ``tokenizer/`` dir, else the manifest's
    reference (a directory or a ``tokenizer.json``)."""
    own = ckpt.directory / TOKENIZER_DIR
    if own.is_dir():
        return tokenizer_files(own)
    ref = ckpt.manifest.get("tokenizer")
    if not ref:
        return []
    path = Path(ref) if Path(ref).is_absolute() else ckpt.directory / ref
    if path.is_dir():
        return tokenizer_files(path)
    if path.is_file():
        return [path, *[p for p in tokenizer_files(path.parent) if p != path]]
    return []


def _read_lf(ckpt: Checkpoint, bound: BoundMapping):
    """``get(lf_name)`` over the checkpoint, after checking its model tensors are the mapping's.
    A LoRA checkpoint's adapted weights are read merged, ``W + (alpha / rank) * B @ A``."""
    from loongforge.core.lora import lora_record, megatron_adapters, merged_weight

    reader = ckpt.reader
    present = {k for k in reader.keys() if not k.startswith(OPTIMIZER_PREFIX)}
    adapters = megatron_adapters(bound, present, ckpt.directory)
    lora = lora_record(ckpt.manifest)
    if adapters and lora is None:
        raise MappingError(f"{ckpt.directory}: adapter tensors but no lora group (rank, alpha) in the manifest")
    expected = {bound.location(n).key for n in bound.lf_names} | {loc.key for pair in adapters.values() for loc in pair}
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        problems = ([f"missing {len(missing)} tensor(s): {summarize_names(missing)}"] if missing else []) + (
            [f"{len(unexpected)} tensor(s) the mapping does not know: {summarize_names(unexpected)}"] if unexpected else [])
        raise MappingError(f"{ckpt.directory}: model tensors do not match the family's mapping: " + "; ".join(problems))

    def get(name: str) -> torch.Tensor:
        weight = read_at(ckpt, bound.location(name))
        if name not in adapters:
            return weight
        assert lora is not None  # adapters without a lora record were refused above
        a, b = (read_at(ckpt, loc) for loc in adapters[name])
        return merged_weight(weight, a, b, lora["alpha"] / lora["rank"])

    return get


def _stream_to_hf(ckpt: Checkpoint, bound: BoundMapping, get, writer: HFWriter, adapter: HFAdapter, family: str, cfg,
                  dtype, progress: bool) -> tuple[Path, list[Path]]:
    def nbytes(name: str) -> int:
        loc = bound.location(name)
        return _nbytes(ckpt, loc.key, len(loc.sizes))

    written = set()
    with _bar(sum(nbytes(n) for n in bound.lf_names), f"{family} LoongForge -> HF", progress) as bar:
        for conv in bound.conversions:
            for name, tensor in bound.hf_outputs(conv, [get(n) for n in conv.lf]):
                tensor = _cast(tensor, dtype)
                written.add(tensor.dtype)
                writer.add(name, tensor)
            bar.update(sum(nbytes(n) for n in conv.lf))
    config = adapter.config_to_hf(cfg)
    floating = sorted(str(d).removeprefix("torch.") for d in written if d.is_floating_point)
    if len(floating) == 1:
        config["dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"] = floating[0]
    tokenizer = _checkpoint_tokenizer(ckpt)
    return writer.finish(config, tokenizer), tokenizer


def lf_to_hf(checkpoint: str | Path, out: str | Path, *, dtype: torch.dtype | None = None, progress: bool = True,
             max_shard_bytes: int = 2 << 30, command: str | None = None) -> Converted:
    """Convert a LoongForge checkpoint (a step directory or a root with ``latest``) into the HF
    model directory ``out``; ``command``: the ``lf-*`` command converting (another's checkpoints
    are refused, naming theirs)."""
    ckpt = Checkpoint(checkpoint)
    if command is not None:
        from loongforge.core.checkpoint_owner import check_checkpoint_command

        check_checkpoint_command(ckpt.manifest, command, ckpt.directory)
    family, adapter, cfg, bound = bind_checkpoint(ckpt.manifest, ckpt.directory / "manifest.json")
    get = _read_lf(ckpt, bound)
    writer = HFWriter(out, max_shard_bytes=max_shard_bytes)
    try:
        path, tokenizer = _stream_to_hf(ckpt, bound, get, writer, adapter, family, cfg, dtype, progress)
    except BaseException:
        writer.abort()
        raise
    return Converted(path, family, cfg, len(bound.export_names), path if has_tokenizer(tokenizer) else None)


def _nbytes(ckpt: Checkpoint, key: str, stacked_axes: int) -> int:
    meta = ckpt.reader.index[key]
    n = torch.empty((), dtype=getattr(torch, meta["dtype"].removeprefix("torch."))).element_size()
    for s in meta["shape"][stacked_axes:]:
        n *= s
    return n
