"""A single-process writer of the LoongForge checkpoint format that streams pieces into
several safetensors files of bounded size (``save_checkpoint`` takes a rank's pieces all at
once; a conversion of a large model must not hold it whole).

The result is the format ``checkpoint.format`` reads: ``manifest.json`` (version, step, tensor
index of pieces, file sizes and hashes, caller metadata), published atomically with
``storage.commit`` (temp dir, fsync, rename, ``latest`` last).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from loongforge.core.checkpoint import FORMAT_VERSION, Piece, storage
from loongforge.core.checkpoint.format import MANIFEST
from loongforge.core.checkpoint.pieces import write_pieces
from loongforge.core.errors import OutputExistsError


class StreamingCheckpointWriter:
    def __init__(self, root: str | Path, step: int = 0, max_shard_bytes: int = 2 << 30):
        self.root = Path(root)
        self.step = int(step)
        self.name = storage.step_dir_name(self.step)
        if (self.root / self.name).exists():
            raise OutputExistsError(f"{self.root / self.name}: already exists; choose a new output directory")
        self.max_shard_bytes = max_shard_bytes
        self.tmp = storage.prepare_temp(self.root, self.name)
        self.index: dict[str, dict] = {}
        self._pending: list[Piece] = []
        self._pending_bytes = 0
        self._files: list[str] = []
        self._parts = 0

    @property
    def final_dir(self) -> Path:
        return self.root / self.name

    def add(self, piece: Piece) -> None:
        entry = self.index.setdefault(piece.key, {"shape": list(piece.global_shape), "dtype": str(piece.tensor.dtype), "pieces": []})
        if entry["shape"] != list(piece.global_shape) or entry["dtype"] != str(piece.tensor.dtype):
            raise ValueError(f"tensor {piece.key!r}: piece at {list(piece.global_offset)} has global shape "
                             f"{list(piece.global_shape)} / {piece.tensor.dtype}, earlier pieces {entry['shape']} / {entry['dtype']}")
        nbytes = piece.tensor.numel() * piece.tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending.append(piece)
        self._pending_bytes += nbytes

    def _flush(self) -> None:
        file = f"part-{self._parts:05d}.safetensors"
        self._parts += 1
        for rec in write_pieces(self.tmp / file, self._pending):
            self.index[rec["entry"].rsplit("@", 1)[0]]["pieces"].append(rec)
        self._files.append(file)
        self._pending, self._pending_bytes = [], 0

    def add_file(self, source: Path, relative: str) -> None:
        """Copy an extra file (a tokenizer file) into the checkpoint, hashed like the shards."""
        dest = self.tmp / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest)
        self._files.append(relative)

    def abort(self) -> None:
        """Remove the unfinished checkpoint (the temp directory); earlier steps are untouched."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self, manifest: dict) -> Path:
        """Write the manifest (``manifest`` holds family, model config, layout...) and publish."""
        if self._pending:
            self._flush()
        files = {f: {"size": (self.tmp / f).stat().st_size, "sha256": storage.sha256_file(self.tmp / f)} for f in self._files}
        doc = {"format_version": FORMAT_VERSION, "step": self.step, "world_size": 1, **manifest,
               "tensors": self.index, "files": files}
        (self.tmp / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True))
        return storage.commit(self.root, self.name)
