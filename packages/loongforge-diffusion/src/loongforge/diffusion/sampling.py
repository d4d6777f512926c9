"""Euler flow sampling with diffusers' ``FlowMatchEulerDiscreteScheduler`` (the Wan 2.2 rule picks
the expert per step by the timestep boundary), then VAE decoding and a PNG grid / GIF. Image-
conditioned models (``model.condition``) start every video from an image: ``sample.image``, or
the dataset samples' own first frames."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from loongforge.diffusion.conditioning import (
    ImageCondition,
    blank_after_first,
    dataset_condition,
    image_tokens,
    model_input,
    token_timesteps,
    with_given_first_frame,
)
from loongforge.diffusion.model.family import DiTConfig
from loongforge.diffusion.packing import grid_of, pack, unpack_outputs


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    cfg: DiTConfig,
    text: torch.Tensor,
    shapes: Sequence[Sequence[int]],
    *,
    num_steps: int,
    shift: float,
    guidance_scale: float = 1.0,
    seed: int = 0,
    num_train_timesteps: int = 1000,
    image_conditions: Sequence[ImageCondition | None] | None = None,
) -> list[torch.Tensor]:
    """Latents ``[C, F, H, W]`` for prompts ``text`` ``[B, L, D]`` (one per shape), from noise, by the
    family model ``model`` (its parts, ``cfg.part_names()``: the first at timesteps at or above
    ``cfg.boundary_ratio``, the second below, as WanPipeline picks Wan 2.2's experts);
    image-conditioned models take one ``ImageCondition`` per shape (as WanImageToVideoPipeline:
    I2V's mask and condition latents on channels and CLIP tokens at every step, TI2V's clean first
    frame at timestep 0, put back into the result)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
    scheduler.set_timesteps(num_steps)
    device = next(model.parameters()).device
    patch = cfg.patch
    parts = model.parts()
    names = cfg.part_names()
    boundary = None if cfg.boundary_ratio is None else cfg.boundary_ratio * num_train_timesteps
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(tuple(s), generator=g) for s in shapes]
    sizes = [x.numel() for x in latents]
    flat = torch.cat([x.flatten() for x in latents])
    negative = torch.zeros_like(text)
    conds = list(image_conditions) if image_conditions is not None else [None] * len(latents)
    images = image_tokens(conds) if cfg.image_dim else None

    def velocity(model, xs, t, prompts):
        inputs = [model_input(cfg, x, c) for x, c in zip(xs, conds)]
        steps = ([token_timesteps(cfg, t, grid_of(x.shape, patch), c) for x, c in zip(xs, conds)]
                 if cfg.condition == "ti2v" else None)
        batch = pack(inputs, t.expand(len(xs)).float(), prompts, patch, image=images, token_timesteps=steps).to(device)
        return torch.cat([v.flatten().float().cpu() for v in unpack_outputs(model(batch), batch, patch)])

    for t in scheduler.timesteps:
        part = parts[names[0] if boundary is None or float(t) >= boundary else names[1]]
        xs = [c.view(x.shape) for c, x in zip(flat.split(sizes), latents)]
        v = velocity(part, xs, t, text)
        if guidance_scale > 1.0:
            v_neg = velocity(part, xs, t, negative)
            v = v_neg + guidance_scale * (v - v_neg)
        flat = scheduler.step(v, t, flat, return_dict=False)[0]
    return [with_given_first_frame(cfg, c.view(x.shape).clone(), cond)
            for c, x, cond in zip(flat.split(sizes), latents, conds)]


def _to_uint8(video: torch.Tensor) -> np.ndarray:
    """``[3, F, H, W]`` in [-1, 1] -> ``[F, H, W, 3]`` uint8."""
    return ((video.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()


def write_grid(rows: Sequence[Sequence[torch.Tensor]], png: str | Path, gif: str | Path | None = None, fps: int = 4) -> list[Path]:
    """Draw videos ``[3, F, H, W]`` in [-1, 1] given as rows (e.g. generated, reference).

    The PNG has one strip per video (its frames left to right), the rows' videos one below the
    other; the GIF animates the frames with each row's videos side by side."""
    from PIL import Image

    videos = [[_to_uint8(v) for v in row] for row in rows]
    cell_h = max(v.shape[1] for row in videos for v in row)
    cell_w = max(v.shape[2] for row in videos for v in row)
    max_f = max(v.shape[0] for row in videos for v in row)
    cols = max(len(row) for row in videos)
    pad = 2
    # PNG: one line per video (its frames left to right), videos of a row one below the other
    lines = [v for row in videos for v in row]
    sheet = np.zeros((len(lines) * (cell_h + pad), max_f * (cell_w + pad), 3), dtype=np.uint8)
    for i, v in enumerate(lines):
        for f in range(v.shape[0]):
            y, x = i * (cell_h + pad), f * (cell_w + pad)
            sheet[y : y + v.shape[1], x : x + v.shape[2]] = v[f]
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(sheet).save(png)
    out = [png]
    if gif is not None:
        frames = []
        for f in range(max_f):
            canvas = np.zeros((len(videos) * (cell_h + pad), cols * (cell_w + pad), 3), dtype=np.uint8)
            for r, row in enumerate(videos):
                for c, v in enumerate(row):
                    y, x = r * (cell_h + pad), c * (cell_w + pad)
                    canvas[y : y + v.shape[1], x : x + v.shape[2]] = v[min(f, v.shape[0] - 1)]
            frames.append(Image.fromarray(canvas))
        gif = Path(gif)
        frames[0].save(gif, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
        out.append(gif)
    return out


def check_sample_image(recipe) -> None:
    """``sample.image`` exists where it is needed and decodes (before anything is loaded)."""
    from loongforge.core.config import ConfigError

    s, m = recipe.sample, recipe.model
    if s.prompts and m.condition != "none" and s.image is None:
        raise ConfigError(f"sample.prompts with model.condition={m.condition!r} need sample.image=PATH "
                          f"(or --image PATH): the image that starts the videos")
    if s.image is not None and not Path(s.image).expanduser().is_file():
        raise ConfigError(f"sample.image={s.image!r}: no such file")
    if s.image is not None:  # it decodes (a DataError naming it if not), before any model is loaded
        from loongforge.diffusion.data.video_io import read_frames

        read_frames(Path(s.image).expanduser(), 1)


def encode_sample_image(recipe, facts: dict, vae, device) -> ImageCondition:
    """``sample.image`` as the condition of a ``sample.num_frames x height x width`` video: the image
    resized and center-cropped, VAE-encoded alone (TI2V) or followed by blank frames (I2V), and its
    CLIP tokens from the dataset's image encoder (I2V with ``model.image_dim``)."""
    from loongforge.core.config import ConfigError
    from loongforge.diffusion.data.encoders import encode_images, encode_video, load_image_encoder
    from loongforge.diffusion.data.video_io import fit_frames, read_frames, usable_frames

    s, m = recipe.sample, recipe.model
    image = fit_frames(read_frames(Path(s.image).expanduser(), 1)[:1], s.height, s.width)  # [3, 1, H, W]
    if m.condition == "ti2v":
        latent = encode_video(vae, image)
    else:
        latent = encode_video(vae, blank_after_first(image, usable_frames(s.num_frames, facts["vae_factors"][0])))
    tokens = None
    if m.image_dim:
        if not facts.get("image_encoder"):
            raise ConfigError(f"sample.image with model.image_dim={m.image_dim} needs the dataset's CLIP image "
                              f"encoder, but its manifest names none (preprocess with image_encoder=DIR)")
        processor, encoder = load_image_encoder(facts["image_encoder"], device)
        (tokens,) = encode_images(processor, encoder, [image[:, 0]])
    return ImageCondition(latent=latent, image=tokens)


def sample_run(recipe, checkpoint: str | Path, out_dir: str | Path) -> list[Path]:
    """``lf-diffusion sample``: generate from a checkpoint of ``recipe``'s run and draw the result."""
    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.checkpoint.format import Checkpoint
    from loongforge.core.models import get_model_spec
    from loongforge.core.lora import LoRAConfig, apply_lora, lora_record
    from loongforge.core.training.torch_checkpoint import load_model
    from loongforge.diffusion.data.encoders import decode_latent, encode_prompts, load_text_encoder, load_vae
    from loongforge.diffusion.data.shards import LatentShards
    from loongforge.diffusion.packing import pad_text

    s, m = recipe.sample, recipe.model
    check_sample_image(recipe)
    m.check_device(get_accelerator().device_type)  # e.g. a run trained in FP8, sampled on an older GPU
    ckpt = Checkpoint(checkpoint)
    device = get_accelerator().device()
    experts = get_model_spec(m.family).build(m)
    lora = lora_record(ckpt.manifest)
    if lora:  # a LoRA run: the same adapted layers, filled from the checkpoint
        apply_lora(experts, LoRAConfig(rank=lora["rank"], alpha=lora["alpha"], target_modules=lora["target_modules"]))
    load_model(experts, ckpt, prefix="model.")
    if s.use_ema and ckpt.manifest.get("ema"):  # EMA covers the trained parameters; the rest keep model weights
        keys = ckpt.reader.keys()
        with torch.no_grad():
            for key, t in experts.state_dict().items():
                if f"ema.{key}" in keys:
                    t.copy_(ckpt.tensor(f"ema.{key}"))
    experts.to(device).eval()

    dataset = LatentShards(ckpt.manifest["data_root"])
    facts = dataset.manifest
    vae = load_vae(facts["vae"], device)
    reference = None
    conds: list[ImageCondition | None] | None = None
    if s.prompts or s.image:
        prompts = list(s.prompts) or [""]  # an image alone: one video, empty prompt
        tokenizer, encoder = load_text_encoder(facts["text_encoder"], facts["tokenizer"], device)
        embeddings = encode_prompts(tokenizer, encoder, prompts, facts["max_sequence_length"])
        t_factor, s_factor = facts["vae_factors"]
        multiple = s_factor * max(m.patch[1:])
        if s.height % multiple or s.width % multiple:
            from loongforge.core.config import ConfigError

            raise ConfigError(f"sample.height={s.height} and sample.width={s.width} must be multiples of {multiple} "
                              f"(the VAE's {s_factor}x times the DiT's patch)")
        shape = [facts["latent_channels"], 1 + (s.num_frames - 1) // t_factor, s.height // s_factor, s.width // s_factor]
        shapes = [shape] * len(embeddings)
        if s.image:
            conds = [encode_sample_image(recipe, facts, vae, device)] * len(embeddings)
    else:
        picks = list(range(min(s.num_samples, len(dataset))))
        loaded = [dataset.load(i) for i in picks]
        embeddings = [t for _, t in loaded]
        shapes = [list(x.shape) for x, _ in loaded]
        reference = [decode_latent(vae, x) for x, _ in loaded]
        if m.condition != "none":  # the samples' own first frames
            conds = [dataset_condition(m, dataset, i, x) for i, (x, _) in zip(picks, loaded)]
    latents = generate(experts, m, pad_text(embeddings, m.text_len), shapes, num_steps=s.num_steps, shift=s.shift,
                       guidance_scale=s.guidance_scale, seed=s.seed,
                       num_train_timesteps=recipe.objective.num_train_timesteps, image_conditions=conds)
    videos = [decode_latent(vae, x) for x in latents]
    rows = [videos] + ([reference] if reference is not None else [])
    out_dir = Path(out_dir)
    name = f"step_{ckpt.step:08d}"
    return write_grid(rows, out_dir / f"{name}.png", out_dir / f"{name}.gif", fps=s.fps)
