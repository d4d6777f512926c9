"""Hugging Face model directories: ``config.json`` + safetensors (one file, or shards listed in
``model.safetensors.index.json``) + tokenizer files.

``HFReader`` opens tensors lazily by name (memory-mapped, one at a time); ``HFWriter`` streams
tensors into shards of bounded size in a temp directory and publishes the finished directory
with one rename, so a conversion that dies leaves no half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loongforge.core.checkpoint import storage
from loongforge.core.errors import OutputExistsError
from loongforge.core.hf_mapping.transforms import MappingError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files a tokenizer (and its chat/generation settings) is made of, copied through conversions;
# a directory holds a tokenizer when it has one of TOKENIZER_MODELS.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "vocab.json")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def tokenizer_files(directory: Path) -> list[Path]:
    return [directory / f for f in TOKENIZER_FILES if (directory / f).is_file()]


def has_tokenizer(files: list[Path]) -> bool:
    return any(p.name in TOKENIZER_MODELS for p in files)


class HFReader:
    """The tensors and config of an HF model directory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise MappingError(f"{self.directory}: not a directory")
        path = self.directory / CONFIG
        try:
            self.config = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise MappingError(f"{path}: missing (an HF model directory needs its config.json)") from exc
        except json.JSONDecodeError as exc:
            raise MappingError(f"{path}: not valid JSON ({exc})") from exc
        self._handles: dict[str, object] = {}

    @cached_property
    def files(self) -> dict[str, str]:
        """Tensor name -> safetensors file (read on first use: a bad config fails first)."""
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise MappingError(f"{index}: not a safetensors index (needs a 'weight_map')") from exc
            for file in sorted(set(weight_map.values())):
                if not (self.directory / file).is_file():
                    raise MappingError(f"{self.directory / file}: listed in {index.name} but missing")
            return dict(weight_map)
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            raise MappingError(f"{self.directory}: no *.safetensors weights (and no {INDEX})")
        files: dict = {}
        for shard in shards:
            for name in self._open(shard.name).keys():
                if name in files:
                    raise MappingError(f"{self.directory}: tensor {name!r} is in both {files[name]} and {shard.name}")
                files[name] = shard.name
        return files

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.directory / file), framework="pt")
            except Exception as exc:  # safetensors raises its own types for bad headers
                raise MappingError(f"{self.directory / file}: cannot read safetensors file ({exc})") from exc
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise MappingError(f"{self.directory}: no tensor {name!r}")
        handle = self._open(self.files[name])
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise MappingError(f"{self.directory / self.files[name]}: cannot read tensor {name!r} ({exc})") from exc

    def nbytes(self, name: str) -> int:
        sl = self._open(self.files[name]).get_slice(name)
        n = DTYPE_BYTES.get(sl.get_dtype(), 4)
        for s in sl.get_shape():
            n *= s
        return n

    def tokenizer_files(self) -> list[Path]:
        return tokenizer_files(self.directory)


class HFWriter:
    """Writes an HF model directory at ``out`` (which must not exist yet)."""

    def __init__(self, out: str | Path, max_shard_bytes: int = 2 << 30):
        self.out = Path(out)
        if self.out.exists():
            raise OutputExistsError(f"{self.out}: already exists; choose a new output directory")
        self.max_shard_bytes = max_shard_bytes
        self.tmp = storage.prepare_temp(self.out.parent, self.out.name)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._total_bytes = 0
        self._names: set[str] = set()
        self._shards: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if name in self._names:
            raise MappingError(f"{self.out}: tensor {name!r} written twice")
        self._names.add(name)
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def _flush(self) -> None:
        part = f".part-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(self.tmp / part), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def abort(self) -> None:
        """Remove the unfinished output (the temp directory)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self, config: dict, tokenizer: Sequence[Path] = ()) -> Path:
        """Write the last shard, the index, ``config.json`` and the tokenizer files; publish."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, name in enumerate(names):
            os.replace(self.tmp / f".part-{i:05d}.safetensors", self.tmp / name)
        if n > 1:
            weight_map = {t: name for name, tensors in zip(names, self._shards) for t in tensors}
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
            (self.tmp / INDEX).write_text(json.dumps(index, indent=2))
        (self.tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in tokenizer:
            shutil.copy2(path, self.tmp / path.name)
        storage.fsync_tree(self.tmp)
        os.replace(self.tmp, self.out)
        storage.fsync_path(self.out.parent)
        return self.out
