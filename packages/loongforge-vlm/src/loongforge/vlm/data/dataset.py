"""The VLM SFT dataset: a cached index of tokenized conversations, media read per sample.

``build_index`` reads the JSONL records once, sizes every image/video from its header (the
pixel budget fixes its grid, so its number of vision tokens), expands each ``<image>`` /
``<video>`` tag into that many placeholder tokens (with ``video_timestamps``, Qwen3-VL's layout:
one run per temporal patch group after its ``<t seconds>`` text), renders the conversation with the
tokenizer's chat template and stores token ids, the assistant-token mask and the media plan in
``CACHE_DIR/vlm-<hash>/``. The hash covers the data file, the tokenizer, the template, the media
settings, the patch geometry and the video layout, so a change of any rebuilds it.

``VLMDataset[i]`` is one sample: next-token ``tokens``/``labels``, ``loss_mask`` (assistant
tokens only), ``position_ids`` (``[3, L]`` multimodal RoPE, or ``[L]``), and its media as
``pixel_values [patches, patch_dim]`` with ``grid_thw [items, 3]``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loongforge.core.cache import build_once
from loongforge.llm.api import DataError, save_token_arrays
from loongforge.vlm.data import media as M
from loongforge.vlm.data.records import IMAGE_TAG, VIDEO_TAG, Record, read_records
from loongforge.vlm.data.tokenizer import VisionTokenIds, vision_text
from loongforge.vlm.positions import VisionItem, mrope_positions

INDEX_VERSION = 3  # 3: InternVL videos as one run per frame
_TAGS = re.compile(f"{re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)}")
_CHUNK = 256


@dataclass(frozen=True)
class MediaPlan:
    """How one image/video of a sample is read."""

    kind: str  # image | video
    path: str
    grid: tuple[int, int, int]  # (t, h, w) in patches
    frames: tuple[int, ...] = ()  # videos: the frame indices read
    seconds_per_grid_t: float = 1.0
    fps: float = 0.0  # videos: the file's frame rate (the frames' times)

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def _plan(kind: str, path: Path, cfg: M.MediaConfig, geo: M.PatchGeometry, where: str) -> MediaPlan:
    if kind == "image":
        return MediaPlan("image", str(path), M.image_grid(path, cfg, geo))
    sampling = M.video_sampling(M.probe_video(path), cfg, geo, f"{where}: {path}")
    info = M.probe_video(path)
    sampling = M.video_sampling(info, cfg, geo, f"{where}: {path}")
    return MediaPlan("video", str(path), sampling.grid, sampling.indices, sampling.seconds_per_grid_t, info.fps)


def frame_seconds(plan: MediaPlan) -> list[float]:
    """The time of each temporal patch group of a video: the mean of its first and last frame's
    (as transformers' Qwen3-VL processor stamps them)."""
    group = len(plan.frames) // plan.grid[0]
    times = [i / plan.fps for i in plan.frames]
    return [(times[k] + times[k + group - 1]) / 2 for k in range(0, len(times), group)]


def _expanded(record: Record, plans: list[MediaPlan], merge: int, video_timestamps: bool,
              placeholders: str = "qwen") -> list[dict]:
    pending = iter(plans)

    def expand(match):
        plan = next(pending)
        seconds = frame_seconds(plan) if video_timestamps and plan.kind == "video" else None
        return vision_text(plan.kind, plan.patches // (merge * merge), seconds, placeholders, frames=plan.grid[0])

    return [{**m, "content": _TAGS.sub(expand, m["content"])} for m in record.messages]


@dataclass(frozen=True)
class VLMIndex:
    directory: Path
    tokens: np.ndarray
    assistant: np.ndarray
    offsets: np.ndarray
    media: list[list[MediaPlan]]
    where: list[str]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def load(cls, directory: Path) -> VLMIndex:
        plans = json.loads((directory / "media.json").read_text())
        media = [[MediaPlan(p["kind"], p["path"], tuple(p["grid"]), tuple(p["frames"]), p["seconds_per_grid_t"],
                            p["fps"]) for p in sample] for sample in plans["media"]]
        return cls(directory, np.load(directory / "tokens.npy", mmap_mode="r"),
                   np.load(directory / "assistant.npy", mmap_mode="r"), np.load(directory / "offsets.npy"),
                   media, plans["where"])


def _index_key(path: Path, tokenizer_dir: Path, template: str | None, cfg: M.MediaConfig, geo: M.PatchGeometry,
               media_root: Path | None, video_timestamps: bool) -> str:
    digest = hashlib.sha256(f"vlm-index-v{INDEX_VERSION}".encode())
    digest.update(hashlib.sha256(path.read_bytes()).digest())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        file = tokenizer_dir / name
        digest.update(name.encode() + (hashlib.sha256(file.read_bytes()).digest() if file.is_file() else b"-"))
    digest.update(json.dumps([template, asdict(cfg), asdict(geo), str(media_root), video_timestamps],
                             sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _write_index(directory: Path, path: Path, tokenizer, template: str | None, cfg: M.MediaConfig,
                 geo: M.PatchGeometry, media_root: Path | None, name: str, video_timestamps: bool) -> None:
    from loongforge.llm.api import ChatRenderer

    renderer = ChatRenderer(tokenizer, template, name=name)
    ids_parts, mask_parts, media, wheres = [], [], [], []
    pending: list[list[dict]] = []  # conversations not yet rendered, and their records' places
    pending_where: list[str] = []

    def flush():
        for ids, mask in renderer.render_many(pending, pending_where):
            ids_parts.append(ids)
            mask_parts.append(mask)
        pending.clear()
        pending_where.clear()

    for record in read_records(path, media_root):
        plans = [_plan(kind, p, cfg, geo, record.where) for kind, p in record.media]
        pending.append(_expanded(record, plans, geo.merge, video_timestamps, cfg.placeholders))
        pending_where.append(record.where)
        media.append(plans)
        wheres.append(record.where)
        if len(pending) >= _CHUNK:
            flush()
    flush()
    if not media:
        raise DataError(f"{path}: no records")
    save_token_arrays(directory, ids_parts, mask_parts)
    (directory / "media.json").write_text(json.dumps({"media": [[asdict(p) for p in s] for s in media], "where": wheres}))
    (directory / "meta.json").write_text(json.dumps({"version": INDEX_VERSION, "file": str(path), "samples": len(media)}) + "\n")


def build_index(path: str | Path, tokenizer, tokenizer_dir: Path, cache_dir: str | Path, cfg: M.MediaConfig,
                geo: M.PatchGeometry, template: str | None = None, media_root: str | Path | None = None,
                video_timestamps: bool = False) -> VLMIndex:
    """Index ``path`` into ``cache_dir`` unless an index of the same inputs is there. With
    torch.distributed initialised every rank calls this; local rank 0 of each node builds.
    ``video_timestamps``: Qwen3-VL's video layout (see the module docstring)."""

    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise DataError(f"data.path: file not found: {path}")
    root = Path(media_root).expanduser().resolve() if media_root is not None else None
    key = _index_key(path, Path(tokenizer_dir), template, cfg, geo, root, video_timestamps)
    directory = Path(cache_dir) / f"vlm-{key}"
    build_once(directory, lambda tmp: _write_index(tmp, path, tokenizer, template, cfg, geo, root, str(tokenizer_dir),
                                                   video_timestamps), "VLM index")
    return VLMIndex.load(directory)


class VLMDataset:
    """Samples of an index (``keep``: the positions used, default all)."""

    def __init__(self, index: VLMIndex, ids: VisionTokenIds, cfg: M.MediaConfig, geo: M.PatchGeometry,
                 rope: str = "mrope", tokens_per_second: float = 2.0, keep: np.ndarray | None = None):
        self.index, self.ids, self.cfg, self.geo = index, ids, cfg, geo
        self.rope, self.tokens_per_second = rope, tokens_per_second
        self.keep = np.arange(len(index)) if keep is None else np.asarray(keep, dtype=np.int64)
        all_lengths = np.diff(index.offsets) - 1
        self.lengths = all_lengths[self.keep]  # input tokens (text + vision) of every sample
        self.patches = np.asarray([sum(p.patches for p in index.media[i]) for i in self.keep], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.keep)

    def subset(self, keep: np.ndarray) -> VLMDataset:
        return VLMDataset(self.index, self.ids, self.cfg, self.geo, self.rope, self.tokens_per_second, self.keep[keep])

    def where(self, i: int) -> str:
        return self.index.where[int(self.keep[i])]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        j = int(self.keep[i])
        lo, hi = self.index.offsets[j], self.index.offsets[j + 1]
        ids = np.asarray(self.index.tokens[lo:hi], dtype=np.int64)
        assistant = np.asarray(self.index.assistant[lo:hi])
        plans = self.index.media[j]
        patches, grids = [], []
        for plan in plans:
            try:
                if plan.kind == "image":
                    x, grid = M.load_image(Path(plan.path), self.cfg, self.geo)
                else:
                    sampling = M.VideoSampling(plan.frames, plan.grid, plan.seconds_per_grid_t)
                    x, grid = M.load_video(Path(plan.path), sampling, self.cfg, self.geo)
            except DataError as err:  # the file is named; say which record uses it
                raise DataError(f"{self.index.where[j]}: {err}") from err
            if grid != plan.grid:
                raise DataError(f"{self.index.where[j]}: {plan.path} now has grid {grid}, the index says {plan.grid} "
                                f"(the file changed; delete {self.index.directory})")
            patches.append(x)
            grids.append(grid)
        tokens = ids[:-1]
        if self.rope != "rope":
            items = [VisionItem(p.grid, p.kind == "video", p.seconds_per_grid_t) for p in plans]
            positions = mrope_positions(tokens, items, (self.ids.image, self.ids.video), self.geo.merge,
                                        self.tokens_per_second, frames_as_images=self.rope == "mrope_interleaved")
        else:
            positions = np.arange(len(tokens), dtype=np.int64)
        patch_dim = 3 * self.geo.temporal_patch_size * self.geo.patch_size ** 2
        return {
            "tokens": tokens,
            "labels": ids[1:],
            "loss_mask": assistant[1:].astype(np.int64),
            "position_ids": positions,
            "pixel_values": np.concatenate(patches) if patches else np.zeros((0, patch_dim), dtype=np.float32),
            "grid_thw": np.asarray(grids, dtype=np.int64).reshape(-1, 3),
        }
