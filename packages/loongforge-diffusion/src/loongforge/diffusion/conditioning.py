"""First-frame image conditioning (``model.condition``): the model input of a sample made from its
noisy latent and its image condition, as diffusers' Wan pipelines build it.

- ``i2v`` (Wan 2.1 / 2.2 I2V, ``WanImageToVideoPipeline``): the noisy latent ``[C, F, h, w]``, a
  mask of ``model.mask_channels`` channels (the VAE's temporal factor: the pixel frames of one
  latent frame; ones on the first latent frame, whose first pixel frame is the given image, zeros
  elsewhere), then the condition latents (the VAE latents of the image followed by blank frames,
  the video's length), concatenated on channels. With ``model.image_dim`` the image's CLIP tokens
  (the vision encoder's penultimate hidden states) also go to the cross-attention. The loss covers
  every frame.
- ``ti2v`` (Wan 2.2 TI2V 5B, ``expand_timesteps``): the first latent frame is the clean latent of
  the image and its tokens get timestep 0; the loss leaves them out. The causal Wan VAE encodes a
  video's first frame alone, so a clip's own first latent frame is its image latent: training
  needs nothing stored. A clip of one latent frame (an image) trains text-to-image, unconditioned.

For training, ``lf-diffusion preprocess`` stores the I2V condition latents (``image_condition=true``)
and CLIP tokens (``image_encoder=DIR``) of every sample next to its latents (``data/shards.py``);
for sampling, ``sample.image`` is encoded the same way (``sampling.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loongforge.diffusion.model.family import DiTConfig


@dataclass
class ImageCondition:
    """What conditions one video on its first frame."""

    latent: torch.Tensor  # i2v: condition latents [C, F, h, w]; ti2v: the clean first frame [C, 1, h, w]
    image: torch.Tensor | None = None  # i2v with image_dim: CLIP tokens [L, image_dim]


def blank_after_first(video: torch.Tensor, num_frames: int | None = None) -> torch.Tensor:
    """The I2V condition video: ``video``'s first frame ``[3, 1, H, W]`` followed by blank (zero)
    frames, ``num_frames`` long (default: ``video``'s length)."""
    num_frames = num_frames or video.shape[1]
    out = video.new_zeros(video.shape[0], num_frames, *video.shape[2:])
    out[:, 0] = video[:, 0]
    return out


def first_frame_mask(channels: int, latent_shape) -> torch.Tensor:
    """I2V mask ``[channels, F, h, w]``: ones on the first latent frame, zeros after."""
    _, f, h, w = latent_shape
    mask = torch.zeros(channels, f, h, w)
    mask[:, 0] = 1.0
    return mask


def conditions(cfg: DiTConfig, latent_frames: int) -> bool:
    """Whether a video of ``latent_frames`` frames is image-conditioned under ``cfg`` (TI2V leaves
    single-frame samples, images, unconditioned: every token would be given)."""
    return cfg.condition == "i2v" or (cfg.condition == "ti2v" and latent_frames > 1)


def model_input(cfg: DiTConfig, noisy: torch.Tensor, cond: ImageCondition | None) -> torch.Tensor:
    """The DiT input of a noisy latent ``[C, F, h, w]`` under its condition (None: unconditioned)."""
    if cfg.condition == "i2v":
        if cond is None:
            raise ValueError("model.condition='i2v' needs every sample's condition latents")
        mask = first_frame_mask(cfg.mask_channels, noisy.shape).to(noisy)
        return torch.cat([noisy, mask, cond.latent.to(noisy)])
    if cfg.condition == "ti2v" and cond is not None:
        return torch.cat([cond.latent.to(noisy), noisy[:, 1:]], dim=1)
    return noisy


def image_tokens(conds: Sequence[ImageCondition | None]) -> torch.Tensor:
    """The CLIP tokens ``[B, L, image_dim]`` of a batch's conditions (I2V with ``image_dim``: every
    sample carries them)."""
    tokens = [c.image for c in conds if c is not None and c.image is not None]
    if len(tokens) != len(conds):
        raise ValueError(f"model.image_dim needs every sample's CLIP image tokens; "
                         f"{len(conds) - len(tokens)} of {len(conds)} have none")
    return torch.stack(tokens)


def token_timesteps(cfg: DiTConfig, t: torch.Tensor, grid, cond: ImageCondition | None) -> torch.Tensor:
    """TI2V per-token timesteps ``[f*h*w]`` of a sample at timestep ``t``: 0 on the first frame's
    tokens when the sample is conditioned."""
    f, h, w = grid
    steps = t.reshape(1).float().expand(f * h * w).clone()
    if cfg.condition == "ti2v" and cond is not None:
        steps[: h * w] = 0.0
    return steps


def given_tokens(cfg: DiTConfig, grid, cond: ImageCondition | None) -> int:
    """Leading tokens of a sample that are given, not denoised (TI2V's first frame): no loss."""
    _, h, w = grid
    return h * w if cfg.condition == "ti2v" and cond is not None else 0


def with_given_first_frame(cfg: DiTConfig, latent: torch.Tensor, cond: ImageCondition | None) -> torch.Tensor:
    """A sampled latent with TI2V's given first frame put back (what the pipeline decodes)."""
    if cfg.condition == "ti2v" and cond is not None:
        return torch.cat([cond.latent.to(latent), latent[:, 1:]], dim=1)
    return latent


def dataset_condition(cfg: DiTConfig, dataset, index: int, x0: torch.Tensor) -> ImageCondition | None:
    """The image condition of sample ``index`` of a ``LatentShards`` dataset whose latent is ``x0``
    (None: unconditioned): TI2V its first latent frame, I2V its stored condition latents and tokens."""
    if not conditions(cfg, x0.shape[1]):
        return None
    if cfg.condition == "ti2v":
        return ImageCondition(latent=x0[:, :1])
    stored = dataset.load_condition(index)
    return ImageCondition(latent=stored["condition"], image=stored.get("image") if cfg.image_dim else None)
