"""The LoongForge checkpoint format (version 1).

``ROOT/step_XXXXXXXX/`` holds:

- ``manifest.json``: format version, step, consumed samples, model family, the full model
  config, the parallel layout it was saved from, the tokenizer reference, any caller metadata,
  the tensor index (key -> global shape, dtype, pieces) and every file's size and sha256;
- ``shard-RRRRR.safetensors``: the pieces rank RRRRR owned (model and optimizer tensors);
- ``objects-RRRRR.pt``: per-rank non-tensor state (RNG states, scheduler, data position), if any.

Saving and loading in a distributed job go through ``save_checkpoint``/``load_checkpoint``
with pieces from every rank; a single writer passes whole tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loongforge.core.checkpoint import storage
from loongforge.core.checkpoint.pieces import CheckpointNotFound, CheckpointReadError, Piece, PieceReader, write_pieces

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _barrier(group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)


def _all_gather(obj, group) -> list:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    return [obj]


def _broadcast(obj, group):
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return box[0]
    return obj


def save_checkpoint(
    root: str | Path,
    step: int,
    tensors: dict[str, torch.Tensor] | list[Piece],
    *,
    manifest: dict | None = None,
    objects: dict[str, Any] | None = None,
    keep_last: int | None = None,
    group=None,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically; every rank of ``group`` calls it.

    ``tensors`` is either whole tensors by name (one writer) or this rank's list of ``Piece``s
    (each piece stored once: callers drop replicas). ``manifest`` holds caller metadata
    (family, config, layout, consumed_samples, tokenizer...). ``objects`` is this rank's
    non-tensor state. ``keep_last`` prunes older step directories after the commit.
    """
    root = Path(root)
    rank, world = _world(group)
    name = storage.step_dir_name(step)
    pieces = (
        [Piece(k, tuple(t.shape), (0,) * t.dim(), t) for k, t in tensors.items()]
        if isinstance(tensors, dict)
        else list(tensors)
    )
    error = refused = None
    if rank == 0:
        try:
            storage.prepare_temp(root, name)
        except OSError as exc:
            error = f"cannot create checkpoint directory under {root}: {exc}"
        except storage.CheckpointOrderError as exc:  # ``latest`` is past this step: nothing is written
            refused = str(exc)
    error, refused = _broadcast((error, refused), group)
    if refused:
        raise storage.CheckpointOrderError(refused)
    if error:
        raise OSError(error)
    tmp = storage.temp_dir(root, name)
    shard = f"shard-{rank:05d}.safetensors"
    records, meta, file_info, failure = [], {}, {}, None
    try:
        records = write_pieces(tmp / shard, pieces) if pieces else []
        meta = {p.key: {"shape": list(p.global_shape), "dtype": str(p.tensor.dtype)} for p in pieces}
        files = [shard] if pieces else []
        if objects:
            obj_file = f"objects-{rank:05d}.pt"
            torch.save(objects, tmp / obj_file)
            files.append(obj_file)
        file_info = {f: {"size": (tmp / f).stat().st_size, "sha256": storage.sha256_file(tmp / f)} for f in files}
    except OSError as exc:  # a full or read-only disk: every rank learns of it, nothing is committed
        failure = _failure(exc, tmp)
    gathered = _all_gather((records, meta, file_info, failure), group)
    failure = next((g[3] for g in gathered if g[3] is not None), None)
    if rank == 0 and failure is None:
        try:
            _write_manifest(tmp, step, world, manifest, gathered)
        except OSError as exc:
            failure = _failure(exc, tmp / MANIFEST)
    failure = _broadcast(failure, group)
    if failure is not None:
        if rank == 0:
            storage.discard_temp(root, name)  # the space it took back; the last checkpoint is untouched
        _barrier(group)
        raise OSError(*failure)
    if rank == 0:
        try:
            storage.commit(root, name)  # ``latest`` moves last: until then the previous checkpoint stands
            storage.prune(root, keep_last)
        except OSError as exc:
            failure = _failure(exc, root)
        except storage.CheckpointOrderError as exc:
            storage.discard_temp(root, name)
            refused = str(exc)
    failure, refused = _broadcast((failure, refused), group)
    if refused:
        raise storage.CheckpointOrderError(refused)
    if failure is not None:
        raise OSError(*failure)
    return root / name


def _failure(exc: OSError, path: Path) -> tuple:
    """An ``OSError`` as picklable ``OSError(*args)`` arguments (errno, message, file)."""
    return (exc.errno, exc.strerror or str(exc), str(exc.filename or path))


def _write_manifest(tmp: Path, step: int, world: int, manifest: dict | None, gathered: list) -> None:
    index: dict[str, dict] = {}
    all_files: dict[str, dict] = {}
    for recs, metas, finfo, _ in gathered:
        all_files.update(finfo)
        for key, m in metas.items():
            entry = index.setdefault(key, {**m, "pieces": []})
            if entry["shape"] != m["shape"] or entry["dtype"] != m["dtype"]:
                raise ValueError(f"tensor {key!r}: ranks disagree on its global shape/dtype")
        for rec in recs:
            key = rec["entry"].rsplit("@", 1)[0]
            index[key]["pieces"].append(rec)
    doc = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "world_size": world,
        **(manifest or {}),
        "tensors": index,
        "files": all_files,
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)


def resolve(path_or_root: str | Path) -> Path:
    """A checkpoint directory, given it or a root holding ``latest``."""
    path = Path(path_or_root)
    if (path / MANIFEST).is_file():
        return path
    latest = storage.latest_checkpoint(path)
    if latest is None:
        raise CheckpointNotFound(f"{path}: neither a checkpoint directory (no {MANIFEST}) nor a root with a 'latest' pointer")
    return latest


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointReadError(f"{path}: missing") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointReadError(f"{path}: not valid JSON ({exc})") from exc
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointReadError(f"{path}: format_version {doc.get('format_version')!r}, expected {FORMAT_VERSION}")
    return doc


def verify_files(directory: Path, manifest: dict, files: list[str] | None = None) -> None:
    """Check size and sha256 of the named files (default: all) against the manifest."""
    for name in files if files is not None else manifest["files"]:
        info = manifest["files"].get(name)
        path = directory / name
        if info is None:
            raise CheckpointReadError(f"{path}: not listed in {directory / MANIFEST}")
        if not path.is_file():
            raise CheckpointReadError(f"{path}: missing")
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointReadError(f"{path}: truncated or rewritten ({size} bytes, manifest says {info['size']})")
        if storage.sha256_file(path) != info["sha256"]:
            raise CheckpointReadError(f"{path}: content hash does not match the manifest (corrupted)")


class Checkpoint:
    """An opened checkpoint: its manifest, tensor reader and per-rank objects."""

    def __init__(self, path_or_root: str | Path, verify: bool = True):
        self.directory = resolve(path_or_root)
        self.manifest = read_manifest(self.directory)
        if verify:
            verify_files(self.directory, self.manifest)
        self.reader = PieceReader(self.directory, self.manifest["tensors"])

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def objects(self, rank: int = 0) -> dict:
        path = self.directory / f"objects-{rank:05d}.pt"
        if not path.is_file():
            return {}
        return torch.load(path, weights_only=False)

    def tensor(self, key: str) -> torch.Tensor:
        return self.reader.read(key)

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {k: self.reader.read(k) for k in self.reader.keys() if k.startswith(prefix)}


def load_checkpoint(path_or_root: str | Path, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Single-reader load: ``(tensors, manifest, objects of rank 0)``."""
    ckpt = Checkpoint(path_or_root, verify=verify)
    return ckpt.tensors(), ckpt.manifest, ckpt.objects(0)
