"""Layout-independent tensor storage: every tensor is stored as pieces of its global shape.

A *piece* is the region of a global tensor one process owns: ``global_offset`` and the local
shape (TP/PP/EP shards are pieces; an unsharded tensor is one piece at offset 0). Pieces are
written to safetensors files under the entry name ``<key>@<o0>_<o1>...``; the manifest maps each
key to its global shape, dtype and pieces. Loading a region of any shape (another layout's
shard) reads only the overlapping slices, so a checkpoint saved under one TP/PP/EP layout
loads into any other. The files are plain safetensors, readable without LoongForge.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from loongforge.core.errors import UserError

DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass
class Piece:
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    tensor: torch.Tensor  # shape == local shape (len == len(global_shape))

    @property
    def entry(self) -> str:
        return f"{self.key}@{'_'.join(map(str, self.global_offset))}"


def piece_record(piece: Piece, file: str) -> dict:
    return {"file": file, "entry": piece.entry, "offset": list(piece.global_offset), "shape": list(piece.tensor.shape)}


def write_pieces(path: Path, pieces: list[Piece]) -> list[dict]:
    """Write pieces into one safetensors file; returns their manifest records."""
    tensors = {p.entry: p.tensor.detach().to("cpu").contiguous() for p in pieces}
    try:
        save_file(tensors, str(path))
    except SafetensorError as exc:  # its I/O errors, as the OSError they are (e.g. a full disk)
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from exc
    return [piece_record(p, path.name) for p in pieces]


class CheckpointReadError(UserError, RuntimeError):
    """A checkpoint file is missing, truncated, corrupted or does not match the model."""


class CheckpointNotFound(CheckpointReadError, FileNotFoundError):
    """No checkpoint where one was named."""


class PieceReader:
    """Reads regions of global tensors from a checkpoint directory's safetensors files."""

    def __init__(self, directory: Path, index: dict):
        self.directory = directory
        self.index = index
        self._handles: dict = {}

    def _open(self, file: str):
        if file not in self._handles:
            path = self.directory / file
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise CheckpointReadError(f"{path}: cannot read safetensors file ({exc})") from exc
        return self._handles[file]

    def keys(self):
        return self.index.keys()

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.index[key]["shape"])

    def read(self, key: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of global tensor ``key`` (default: all of it)."""
        if key not in self.index:
            raise CheckpointReadError(f"{self.directory}: tensor {key!r} is not in this checkpoint")
        meta = self.index[key]
        gshape = tuple(meta["shape"])
        offset = tuple(offset) if offset is not None else (0,) * len(gshape)
        shape = tuple(shape) if shape is not None else gshape
        if len(offset) != len(gshape) or any(o + s > g for o, s, g in zip(offset, shape, gshape)):
            raise CheckpointReadError(
                f"{self.directory}: tensor {key!r} has shape {list(gshape)} in the checkpoint; the model asks "
                f"for region offset={list(offset)} shape={list(shape)} (config mismatch?)"
            )
        out = torch.empty(shape, dtype=DTYPES[meta["dtype"]])
        covered = 0
        for rec in meta["pieces"]:
            lo = [max(o, po) for o, po in zip(offset, rec["offset"])]
            hi = [min(o + s, po + ps) for o, s, po, ps in zip(offset, shape, rec["offset"], rec["shape"])]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            try:
                sl = self._open(rec["file"]).get_slice(rec["entry"])
                src = sl[tuple(slice(a - po, b - po) for a, b, po in zip(lo, hi, rec["offset"]))]
            except CheckpointReadError:
                raise
            except Exception as exc:
                raise CheckpointReadError(f"{self.directory / rec['file']}: cannot read {rec['entry']!r} ({exc})") from exc
            out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))] = src
            n = 1
            for a, b in zip(lo, hi):
                n *= b - a
            covered += n
        if covered != out.numel():
            raise CheckpointReadError(f"{self.directory}: tensor {key!r} region is not fully covered by its pieces")
        return out
