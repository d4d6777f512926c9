"""The built-in dataset: short clips of a coloured shape moving over a plain background, in mixed
resolutions and durations (single-frame clips are PNG images), each with a caption naming its
colour, shape, direction and background. Everything here (clips, the tiny random VAE, text
encoder and CLIP vision encoder used to preprocess them) is generated deterministically from a
seed on first use and cached, so ``lf-diffusion train`` with no arguments needs no download. The
shards hold what image-to-video training reads too (I2V condition latents and CLIP tokens of the
first frame), so every debug config trains on the same set.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from loongforge.diffusion.data.video_io import write_video

COLORS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (60, 90, 235), "yellow": (235, 215, 40), "white": (245, 245, 245)}
BACKGROUNDS = {"black": (12, 12, 12), "gray": (110, 110, 110), "purple": (70, 30, 90)}
SHAPES = ("circle", "square")
DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
SIZES = ((32, 32), (32, 48), (48, 32))  # (height, width) in pixels
LENGTHS = (1, 5, 9)  # frames (1 + 4k: the Wan VAE's temporal grid)
VERSION = "moving_shapes_v2"  # v2: + I2V condition latents and CLIP tokens


def cache_root() -> Path:
    """The built-in set's folder in the LoongForge cache (``loongforge.core.cache``)."""
    from loongforge.core.cache import cache_dir

    return cache_dir("diffusion", VERSION)


def vocabulary() -> list[str]:
    words = {"a", "moving", "on", "background"} | set(COLORS) | set(BACKGROUNDS) | set(SHAPES) | set(DIRECTIONS)
    return sorted(words)


def render_clip(rng: np.random.RandomState, height: int, width: int, frames: int) -> tuple[np.ndarray, str]:
    color, shape, direction, bg = (
        list(COLORS)[rng.randint(len(COLORS))],
        SHAPES[rng.randint(len(SHAPES))],
        list(DIRECTIONS)[rng.randint(len(DIRECTIONS))],
        list(BACKGROUNDS)[rng.randint(len(BACKGROUNDS))],
    )
    radius = rng.randint(min(height, width) // 6, min(height, width) // 4 + 1)
    cy, cx = rng.randint(radius, height - radius), rng.randint(radius, width - radius)
    dy, dx = DIRECTIONS[direction]
    speed = max(1, min(height, width) // 12)
    yy, xx = np.mgrid[0:height, 0:width]
    video = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        py = (cy + dy * speed * t) % height
        px = (cx + dx * speed * t) % width
        if shape == "circle":
            inside = (yy - py) ** 2 + (xx - px) ** 2 <= radius**2
        else:
            inside = (np.abs(yy - py) <= radius) & (np.abs(xx - px) <= radius)
        video[t] = BACKGROUNDS[bg]
        video[t][inside] = COLORS[color]
    motion = f" moving {direction}" if frames > 1 else ""
    return video, f"a {color} {shape}{motion} on a {bg} background"


def generate_clips(out_dir: Path, num_clips: int = 48, seed: int = 0) -> Path:
    """The clips and ``metadata.jsonl`` (``file_name``, ``text``) in ``out_dir``, written there once
    (``loongforge.core.cache.write_atomically``)."""
    from loongforge.core.cache import write_atomically

    if not (out_dir / "metadata.jsonl").is_file():
        write_atomically(out_dir, lambda tmp: _write_clips(tmp, num_clips, seed))
    return out_dir


def _write_clips(out_dir: Path, num_clips: int, seed: int) -> None:
    from PIL import Image

    rng = np.random.RandomState(seed)
    rows = []
    for i in range(num_clips):
        frames = LENGTHS[i % len(LENGTHS)]
        height, width = SIZES[(i // len(LENGTHS)) % len(SIZES)]
        video, caption = render_clip(rng, height, width, frames)
        if frames == 1:
            name = f"clip_{i:03d}.png"
            Image.fromarray(video[0]).save(out_dir / name)
        else:
            name = f"clip_{i:03d}.mp4"
            write_video(out_dir / name, video)
        rows.append({"file_name": name, "text": caption})
    (out_dir / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                temperal_downsample=[False, True, True])
# 32x32 input, 16x16 patches: 5 tokens of width 32 (the tiny I2V config's model.image_dim)
TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                 patch_size=16, projection_dim=32)
TINY_TEXT = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                 relative_attention_max_distance=16, dropout_rate=0.0)


def build_tiny_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out_dir))


def build_tiny_encoders(out_dir: Path, clips_dir: Path, seed: int = 0) -> Path:
    """A random tiny UMT5 encoder + word-level tokenizer, a random tiny Wan VAE and a random tiny
    CLIP vision encoder, saved in the diffusers pipeline layout (``vae/``, ``text_encoder/``,
    ``tokenizer/``, ``image_encoder/``, ``image_processor/``), written into ``out_dir`` once
    (``loongforge.core.cache.write_atomically``). The VAE's ``latents_mean``/``latents_std`` are
    measured on the clips so stored latents are ~unit scale."""
    from loongforge.core.cache import write_atomically

    if not (out_dir / "image_processor").is_dir():
        write_atomically(out_dir, lambda tmp: _write_tiny_encoders(tmp, clips_dir, seed))
    return out_dir


@torch.no_grad()
def _write_tiny_encoders(out_dir: Path, clips_dir: Path, seed: int) -> None:
    from diffusers import AutoencoderKLWan
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from loongforge.diffusion.data.video_io import read_frames, to_model_input

    build_tiny_tokenizer(out_dir / "tokenizer")
    torch.manual_seed(seed)
    vocab_size = 3 + len(vocabulary())
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, **TINY_TEXT))
    encoder.save_pretrained(str(out_dir / "text_encoder"))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(**TINY_VAE, latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    mus = []
    for row in (json.loads(line) for line in (clips_dir / "metadata.jsonl").read_text().splitlines()[:12]):
        video = to_model_input(read_frames(clips_dir / row["file_name"], 9), 48 * 48, 16, 4)
        mus.append(vae.encode(video[None]).latent_dist.mean[0].flatten(1))
    mu = torch.cat(mus, dim=1)
    vae.register_to_config(latents_mean=mu.mean(1).tolist(), latents_std=mu.std(1).tolist())
    vae.save_pretrained(str(out_dir / "vae"))
    torch.manual_seed(seed + 2)
    CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP)).save_pretrained(str(out_dir / "image_encoder"))
    side = TINY_CLIP["image_size"]
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(
        str(out_dir / "image_processor"))


MAX_FRAMES = 9  # the longest clips


def latents_dir(num_clips: int, max_frames: int = MAX_FRAMES) -> Path:
    """Where the built-in set's latents of clips cut to ``max_frames`` frames are cached."""
    root = cache_root() / f"n{num_clips}"
    return root / ("latents" if max_frames == MAX_FRAMES else f"latents_f{max_frames}")


def builtin_dataset(num_clips: int = 48, show_progress: bool = True, max_frames: int = MAX_FRAMES) -> Path:
    """The preprocessed built-in set (built into the cache on first use, each part written once:
    ``loongforge.core.cache.write_atomically``); returns its latents dir. ``max_frames=1`` encodes
    every clip's first frame alone: an image set of one-frame latents."""
    from loongforge.core.cache import write_atomically
    from loongforge.diffusion.preprocess import PreprocessConfig, preprocess

    root = cache_root() / f"n{num_clips}"
    latents = latents_dir(num_clips, max_frames)
    if (latents / "manifest.json").is_file():
        return latents
    clips = generate_clips(root / "clips", num_clips)
    encoders = build_tiny_encoders(root / "encoders", clips)

    def write(tmp: Path) -> None:
        cfg = PreprocessConfig(input=str(clips), output=str(tmp), vae=str(encoders), text_encoder=str(encoders),
                               max_sequence_length=16, max_frames=max_frames, max_area=48 * 48, patch_size=2,
                               shard_size=16, image_condition=True, image_encoder=str(encoders),
                               progress=show_progress)
        preprocess(cfg, rank=0, world=1)

    write_atomically(latents, write)
    return latents
