"""``lf-diffusion preprocess``: videos/images + captions -> latent shards.

Input: a directory with ``metadata.jsonl`` whose lines are ``{"file_name": ..., "text": ...}``
(file names relative to it; videos are decoded with PyAV, images with Pillow). Each sample is cut
to ``1 + 4k`` frames (at most ``max_frames``, every ``frame_stride``-th), resized to at most
``max_area`` pixels keeping its aspect ratio and center-cropped to sides divisible by the VAE's
spatial factor times the DiT patch, encoded with the VAE, and its caption with the text encoder.
Samples keep their own size: mixed resolutions and durations are packed at training time.

For Wan 2.1 I2V training, ``image_condition=true`` also encodes each sample's condition video (its
first frame followed by blank frames) and ``image_encoder=DIR`` the first frame's CLIP tokens
(``loongforge.diffusion.conditioning``); Wan 2.2 TI2V needs neither (a clip's first latent frame
is its image latent).

Shards are planned from the sorted metadata, so a rerun resumes by skipping finished shards; under
``torchrun`` rank ``r`` encodes shards ``r, r + world, ...`` and rank 0 writes the manifest.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge.core.accelerators import get_accelerator
from loongforge.core.distributed import world_size_from_env
from loongforge.core.metrics import progress
from loongforge.diffusion.data import shards
from loongforge.diffusion.conditioning import blank_after_first
from loongforge.diffusion.data.encoders import (
    encode_images,
    encode_prompts,
    encode_video,
    image_encoder_width,
    load_image_encoder,
    load_text_encoder,
    load_vae,
    read_component_config,
    vae_factors,
)
from loongforge.diffusion.data.video_io import read_frames, to_model_input

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class PreprocessConfig:
    input: str = ""  # directory with metadata.jsonl and the media files
    output: str = ""  # where shards go
    vae: str = ""  # local AutoencoderKLWan directory (or a pipeline directory with vae/)
    text_encoder: str = ""  # local T5/UMT5 encoder directory (or a pipeline directory with text_encoder/)
    tokenizer: str | None = None  # default: the text_encoder path (or its pipeline's tokenizer/)
    # Wan 2.1 I2V: also store each sample's condition latents (its first frame followed by blank
    # frames, VAE-encoded: a second VAE pass per sample)
    image_condition: bool = False
    # Wan 2.1 I2V: a local CLIP vision encoder (or a pipeline directory with image_encoder/ and
    # image_processor/) whose tokens of each sample's first frame are stored; null: none
    image_encoder: str | None = None
    max_sequence_length: int = 512
    max_frames: int = 81
    frame_stride: int = 1
    max_area: int = 480 * 832
    patch_size: int = 2  # the DiT's spatial patch: sides become multiples of vae_spatial * patch_size
    shard_size: int = 64
    storage_dtype: str = "fp32"  # fp32 | bf16
    encoder_dtype: str = "fp32"  # fp32 | bf16 for running the VAE and text encoder
    progress: bool = True

    def __post_init__(self):
        for key in ("input", "output", "vae", "text_encoder"):
            if not getattr(self, key):
                raise ValueError(f"preprocess.{key} is required (e.g. {key}=/path)")
        for key in ("max_sequence_length", "max_frames", "frame_stride", "max_area", "patch_size", "shard_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"preprocess.{key}={getattr(self, key)}: must be >= 1")
        for key in ("storage_dtype", "encoder_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"preprocess.{key}={getattr(self, key)!r}: one of {', '.join(DTYPES)}")


def read_metadata(input_dir: Path) -> list[dict]:
    path = input_dir / "metadata.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (one JSON object per line with 'file_name' and 'text')")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from exc
        for key in ("file_name", "text"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{path}:{n}: missing string field {key!r}")
        if not (input_dir / row["file_name"]).is_file():
            raise FileNotFoundError(f"{path}:{n}: {input_dir / row['file_name']} does not exist")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no samples")
    return rows


def settings_of(cfg: PreprocessConfig, rows: list[dict]) -> dict:
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("output", "progress")}
    for key in ("input", "vae", "text_encoder", "tokenizer", "image_encoder"):
        if keep[key]:
            keep[key] = str(Path(keep[key]).expanduser().resolve())
    for key in ("image_condition", "image_encoder"):  # recorded when used: text-to-video outputs stay resumable
        if not keep[key]:
            del keep[key]
    keep["files"] = [r["file_name"] for r in rows]
    return keep


def preprocess(cfg: PreprocessConfig, rank: int | None = None, world: int | None = None) -> Path | None:
    """Encode this rank's unfinished shards; returns the manifest path once all shards exist.

    ``rank``/``world`` default to the torch.distributed job (every rank must call, and barriers
    order the manifest after all shards; ``loongforge.core.distributed.init_distributed`` joins
    it, as ``lf-diffusion preprocess`` does) or to one process; passed explicitly, this process
    works alone on that rank's shards.
    """
    distributed = rank is None and dist.is_available() and dist.is_initialized()
    if distributed:
        rank, world = dist.get_rank(), dist.get_world_size()
    elif rank is None:
        if world_size_from_env() > 1:
            raise RuntimeError(
                f"preprocess: WORLD_SIZE={world_size_from_env()} but this process has joined no process group; "
                "call loongforge.core.distributed.init_distributed first, or pass rank and world"
            )
        rank, world = 0, 1
    elif world is None:
        raise ValueError("pass world together with rank")
    input_dir, out_dir = Path(cfg.input).expanduser(), Path(cfg.output).expanduser()
    rows = read_metadata(input_dir)
    if rank == 0 or not distributed:
        shards.check_settings(out_dir, settings_of(cfg, rows))
    if distributed:
        dist.barrier()
    plan = [rows[i : i + cfg.shard_size] for i in range(0, len(rows), cfg.shard_size)]
    mine = [i for i in range(len(plan)) if i % world == rank]
    todo = [i for i in mine if shards.finished_record(out_dir, i) is None]

    vae_cfg = read_component_config(cfg.vae, "vae")
    t_factor, s_factor = vae_factors(vae_cfg)
    if todo:
        device = get_accelerator().device()
        vae = load_vae(cfg.vae, device, DTYPES[cfg.encoder_dtype])
        tokenizer, encoder = load_text_encoder(cfg.text_encoder, cfg.tokenizer, device, DTYPES[cfg.encoder_dtype])
        if cfg.image_encoder:
            image_processor, image_encoder = load_image_encoder(cfg.image_encoder, device, DTYPES[cfg.encoder_dtype])
    done = sum(len(plan[i]) for i in mine if i not in todo)
    bar = progress(sum(len(plan[i]) for i in mine), "preprocess", enabled=cfg.progress, initial=done)
    try:
        for i in todo:
            samples = []
            embeddings = encode_prompts(tokenizer, encoder, [r["text"] for r in plan[i]], cfg.max_sequence_length)
            for row, text in zip(plan[i], embeddings):
                source = input_dir / row["file_name"]
                try:
                    frames = read_frames(source, cfg.max_frames, cfg.frame_stride)
                    video = to_model_input(frames, cfg.max_area, s_factor * cfg.patch_size, t_factor)
                except ValueError as exc:
                    raise ValueError(f"{source}: {exc}") from exc
                latents = encode_video(vae, video)
                record = {"source": row["file_name"], "text": row["text"], "latent_shape": list(latents.shape),
                          "video_shape": list(video.shape), "text_tokens": int(text.shape[0])}
                sample = {"latents": latents, "text": text, "record": record}
                if cfg.image_condition:
                    sample["condition"] = encode_video(vae, blank_after_first(video))
                if cfg.image_encoder:
                    (sample["image"],) = encode_images(image_processor, image_encoder, [video[:, 0]])
                samples.append(sample)
                bar.update(1)
            shards.write_shard(out_dir, i, samples, DTYPES[cfg.storage_dtype])
    finally:
        bar.close()
    if distributed:
        dist.barrier()
    if rank != 0:
        return None
    facts = {
        "latent_channels": vae_cfg["z_dim"],
        "text_dim": read_component_config(cfg.text_encoder, "text_encoder")["d_model"],
        "vae_factors": [t_factor, s_factor],
        "vae": str(Path(cfg.vae).expanduser().resolve()),
        "text_encoder": str(Path(cfg.text_encoder).expanduser().resolve()),
        "tokenizer": str(Path(cfg.tokenizer or cfg.text_encoder).expanduser().resolve()),
        "max_sequence_length": cfg.max_sequence_length,
        "image_condition": cfg.image_condition,
        "image_encoder": str(Path(cfg.image_encoder).expanduser().resolve()) if cfg.image_encoder else None,
        "image_dim": image_encoder_width(cfg.image_encoder) if cfg.image_encoder else None,
    }
    return shards.write_manifest(out_dir, len(plan), facts)
