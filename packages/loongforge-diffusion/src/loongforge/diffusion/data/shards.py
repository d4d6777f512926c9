"""Latent shards on disk.

A preprocessed dataset directory holds

- ``preprocess.json``: the settings that produced it (re-running with other settings is refused);
- ``shard-NNNNN.safetensors``: tensors ``{j}.latents`` ``[z, f, h, w]`` and ``{j}.text`` ``[L_j, D]``
  for the shard's samples ``j``; for image-to-video training also ``{j}.condition`` (the I2V
  condition latents: the first frame followed by blank frames, ``[z, f, h, w]``) and ``{j}.image``
  (the first frame's CLIP tokens ``[L_img, D_img]``), see ``loongforge.diffusion.conditioning``;
- ``shard-NNNNN.json``: the shard's sample records, file size and sha256, written after the shard
  file has been renamed into place, so its presence means the shard is finished;
- ``manifest.json``: every shard record plus dataset facts, written once all shards are done.

Every file is written to a temporary name and renamed, so an interrupted run leaves only whole
shards and resumes by skipping them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loongforge.core.errors import DataError

FORMAT = "loongforge-diffusion-latents"
VERSION = 1
MANIFEST = "manifest.json"
CONDITION_KEYS = ("condition", "image")  # optional per-sample tensors of image-to-video data
SETTINGS = "preprocess.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def record_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_shard(out_dir: Path, index: int, samples: list[dict], dtype: torch.dtype) -> dict:
    """Write one shard; ``samples`` have ``latents``, ``text`` tensors (optionally ``condition``,
    ``image``) and a ``record`` dict."""
    tensors = {}
    for j, s in enumerate(samples):
        for key in ("latents", "text", *CONDITION_KEYS):
            if s.get(key) is not None:
                tensors[f"{j}.{key}"] = s[key].to(dtype).contiguous()
    path = out_dir / shard_name(index)
    tmp = out_dir / f".{path.name}.tmp"
    save_file(tensors, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    record = {"index": index, "file": path.name, "size": path.stat().st_size, "sha256": _sha256(path),
              "samples": [s["record"] for s in samples]}
    _atomic_write_text(out_dir / record_name(index), json.dumps(record, indent=1) + "\n")
    return record


def finished_record(out_dir: Path, index: int) -> dict | None:
    """The shard's record if the shard is complete on disk, else None."""
    rec_path, path = out_dir / record_name(index), out_dir / shard_name(index)
    if not rec_path.is_file() or not path.is_file():
        return None
    try:
        record = json.loads(rec_path.read_text())
    except json.JSONDecodeError:
        return None
    return record if record.get("size") == path.stat().st_size else None


def check_settings(out_dir: Path, settings: dict) -> None:
    """Record the settings of a new output dir, or refuse to mix settings in an existing one."""
    path = out_dir / SETTINGS
    if path.is_file():
        old = json.loads(path.read_text())
        for key in sorted(set(old) | set(settings)):
            if old.get(key) != settings.get(key):
                raise DataError(
                    f"{path}: this directory was preprocessed with {key}={old.get(key)!r}, now {key}={settings.get(key)!r}; "
                    "use a new output directory"
                )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(path, json.dumps(settings, indent=1, sort_keys=True) + "\n")


def write_manifest(out_dir: Path, num_shards: int, facts: dict) -> Path | None:
    """Write ``manifest.json`` once every shard is finished; returns it (None if some are missing)."""
    records = [r for r in (finished_record(out_dir, i) for i in range(num_shards)) if r is not None]
    if len(records) < num_shards:
        return None
    settings = json.loads((out_dir / SETTINGS).read_text())
    doc = {"format": FORMAT, "version": VERSION, "settings": settings, **facts,
           "num_samples": sum(len(r["samples"]) for r in records), "shards": records}
    path = out_dir / MANIFEST
    _atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    return path


def read_manifest(root: str | Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path}: missing (run `lf-diffusion preprocess` into {root} first, or finish it)")
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise DataError(f"{path}: not a {FORMAT} v{VERSION} manifest (format={doc.get('format')!r}, version={doc.get('version')!r})")
    return doc


class LatentShards:
    """Random access to the samples of a preprocessed directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.index: list[tuple[str, int]] = []
        self.records: list[dict] = []
        for shard in self.manifest["shards"]:
            path = self.root / shard["file"]
            if not path.is_file():
                raise DataError(f"{path}: missing ({self.root / MANIFEST} lists it)")
            if path.stat().st_size != shard["size"]:
                raise DataError(f"{path}: truncated or overwritten: {path.stat().st_size} bytes, {self.root / MANIFEST} "
                                f"records {shard['size']}")
            for j, rec in enumerate(shard["samples"]):
                self.index.append((shard["file"], j))
                self.records.append(rec)
        self._handles: dict[str, safe_open] = {}

    def __len__(self) -> int:
        return len(self.index)

    def latent_shape(self, i: int) -> list[int]:
        return self.records[i]["latent_shape"]

    def _handle(self, i: int):
        """The open shard of sample ``i`` and the sample's index in it."""
        file, j = self.index[i]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.root / file), framework="pt")
        return self._handles[file], j

    def load(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latents [z, f, h, w], text [L, D])`` of sample ``i`` in fp32."""
        h, j = self._handle(i)
        return h.get_tensor(f"{j}.latents").float(), h.get_tensor(f"{j}.text").float()

    def load_condition(self, i: int) -> dict[str, torch.Tensor]:
        """The stored image-condition tensors of sample ``i`` (``condition``, ``image``: those present), fp32."""
        h, j = self._handle(i)
        keys = set(h.keys())
        return {key: h.get_tensor(f"{j}.{key}").float() for key in CONDITION_KEYS if f"{j}.{key}" in keys}
