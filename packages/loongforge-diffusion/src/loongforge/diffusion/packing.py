"""Sequence packing: videos of different sizes and lengths as one token sequence.

Each latent ``[C, F, H, W]`` becomes ``f*h*w`` patch tokens (``f = F/pt`` ...), row-major over
(frame, row, column) like diffusers' ``patch_embedding(...).flatten(2)``. A pack concatenates the
tokens of its samples and remembers, per token, the sample it belongs to and its grid position
(for 3D RoPE), and per sample its boundaries (attention never crosses them), timestep and prompt.
Optional padding makes the length divisible by the context-parallel size; padded tokens form a
segment of their own in self-attention and carry zero loss weight. Image-conditioned packs carry
per-sample image tokens (Wan 2.1 I2V's CLIP embeddings) and may give every token its own timestep
(Wan 2.2 TI2V: 0 on the clean first frame).

Input patches are flattened in ``Conv3d`` weight order ``(C, pt, ph, pw)``; outputs and targets in
``proj_out`` order ``(pt, ph, pw, C)``, as diffusers unpatchifies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def grid_of(shape: Sequence[int], patch: Sequence[int]) -> tuple[int, int, int]:
    """Post-patch (frames, rows, columns) of a latent of shape ``[C, F, H, W]``."""
    _, f, h, w = shape
    pt, ph, pw = patch
    if f % pt or h % ph or w % pw:
        raise ValueError(f"latent shape {list(shape)} is not divisible by patch size {list(patch)}")
    return f // pt, h // ph, w // pw


def num_tokens(shape: Sequence[int], patch: Sequence[int]) -> int:
    f, h, w = grid_of(shape, patch)
    return f * h * w


def patchify_input(latent: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """``[C, F, H, W]`` -> ``[f*h*w, C*pt*ph*pw]`` (Conv3d weight order)."""
    c = latent.shape[0]
    f, h, w = grid_of(latent.shape, patch)
    pt, ph, pw = patch
    x = latent.reshape(c, f, pt, h, ph, w, pw).permute(1, 3, 5, 0, 2, 4, 6)
    return x.reshape(f * h * w, c * pt * ph * pw)


def patchify_output(latent: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """``[C, F, H, W]`` -> ``[f*h*w, pt*ph*pw*C]`` (``proj_out`` order): targets for the loss."""
    c = latent.shape[0]
    f, h, w = grid_of(latent.shape, patch)
    pt, ph, pw = patch
    x = latent.reshape(c, f, pt, h, ph, w, pw).permute(1, 3, 5, 2, 4, 6, 0)
    return x.reshape(f * h * w, pt * ph * pw * c)


def unpatchify_output(tokens: torch.Tensor, grid: Sequence[int], patch: Sequence[int]) -> torch.Tensor:
    """Inverse of ``patchify_output``: ``[f*h*w, pt*ph*pw*C]`` -> ``[C, F, H, W]``."""
    f, h, w = grid
    pt, ph, pw = patch
    x = tokens.reshape(f, h, w, pt, ph, pw, -1).permute(6, 0, 3, 1, 4, 2, 5)
    return x.reshape(x.shape[0], f * pt, h * ph, w * pw)


def grid_positions(grid: Sequence[int], device=None) -> torch.Tensor:
    """``[f*h*w, 3]`` (frame, row, column) of every token of one sample."""
    f, h, w = grid
    axes = torch.meshgrid(
        torch.arange(f, device=device), torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    return torch.stack([a.reshape(-1) for a in axes], dim=1)


@dataclass
class PackedBatch:
    patches: torch.Tensor  # [N, C*pt*ph*pw] input patch features
    positions: torch.Tensor  # [N, 3] grid position of each token in its sample
    sample_index: torch.Tensor  # [N] sample of each token (padding tokens: the last sample)
    grids: list[tuple[int, int, int]]  # per sample post-patch (f, h, w)
    timesteps: torch.Tensor  # [B] model timesteps (sigma * num_train_timesteps)
    text: torch.Tensor  # [B, L, text_dim] prompt embeddings, zero-padded to L
    num_pad: int = 0
    image: torch.Tensor | None = None  # [B, L_img, image_dim] image tokens (I2V), or None
    token_timesteps: torch.Tensor | None = None  # [N] per-token timesteps (TI2V), or None: the sample's
    # [B] prompt tokens of each sample before the zero padding to L (a family that masks the padding
    # reads them), or None: all L
    text_lengths: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return len(self.grids)

    @property
    def num_tokens(self) -> int:
        return self.patches.shape[0]

    @property
    def sample_bounds(self) -> list[int]:
        """Token offsets of the samples (``B + 1`` entries, padding excluded)."""
        out = [0]
        for f, h, w in self.grids:
            out.append(out[-1] + f * h * w)
        return out

    @property
    def self_attention_bounds(self) -> list[int]:
        """Self-attention segments: one per sample, plus one for the padding."""
        bounds = self.sample_bounds
        return bounds + [self.num_tokens] if self.num_pad else bounds

    @property
    def cross_attention_bounds(self) -> list[int]:
        """Cross-attention segments: one per sample (padding reads the last sample's prompt)."""
        bounds = self.sample_bounds
        bounds[-1] = self.num_tokens
        return bounds

    def to(self, device) -> "PackedBatch":
        return PackedBatch(
            patches=self.patches.to(device),
            positions=self.positions.to(device),
            sample_index=self.sample_index.to(device),
            grids=list(self.grids),
            timesteps=self.timesteps.to(device),
            text=self.text.to(device),
            num_pad=self.num_pad,
            image=None if self.image is None else self.image.to(device),
            token_timesteps=None if self.token_timesteps is None else self.token_timesteps.to(device),
            text_lengths=None if self.text_lengths is None else self.text_lengths.to(device),
        )


def pad_text(embeddings: Sequence[torch.Tensor], text_len: int) -> torch.Tensor:
    """``[L_i, D]`` prompt embeddings -> ``[B, text_len, D]``, zero-padded like WanPipeline."""
    out = embeddings[0].new_zeros(len(embeddings), text_len, embeddings[0].shape[-1])
    for i, e in enumerate(embeddings):
        if e.shape[0] > text_len:
            raise ValueError(f"prompt embedding {i} has {e.shape[0]} tokens, more than model.text_len={text_len}")
        out[i, : e.shape[0]] = e
    return out


def pack(
    latents: Sequence[torch.Tensor],
    timesteps: torch.Tensor,
    text: torch.Tensor,
    patch: Sequence[int],
    pad_to_multiple: int = 1,
    image: torch.Tensor | None = None,
    token_timesteps: Sequence[torch.Tensor] | None = None,
    text_lengths: Sequence[int] | None = None,
) -> PackedBatch:
    """Pack ``B`` latents ``[C, F_i, H_i, W_i]`` with their timesteps ``[B]`` and prompts ``[B, L, D]``;
    optionally image tokens ``[B, L_img, D_img]`` and per-token timesteps (one ``[f_i*h_i*w_i]``
    tensor per sample, in token order; padding takes the last sample's timestep) and each prompt's
    tokens before its padding."""
    if len(latents) == 0:
        raise ValueError("cannot pack an empty list of latents")
    if image is not None and image.shape[0] != len(latents):
        raise ValueError(f"{len(latents)} latents need image tokens [{len(latents)}, L, D]; got {list(image.shape)}")
    if timesteps.shape != (len(latents),) or text.shape[0] != len(latents):
        raise ValueError(
            f"{len(latents)} latents need timesteps [{len(latents)}] and text [{len(latents)}, L, D]; "
            f"got {list(timesteps.shape)} and {list(text.shape)}"
        )
    grids = [grid_of(x.shape, patch) for x in latents]
    patches = [patchify_input(x, patch) for x in latents]
    positions = [grid_positions(g, device=latents[0].device) for g in grids]
    index = [torch.full((p.shape[0],), i, dtype=torch.long, device=latents[0].device) for i, p in enumerate(patches)]
    total = sum(p.shape[0] for p in patches)
    num_pad = (-total) % pad_to_multiple
    if num_pad:
        patches.append(patches[0].new_zeros(num_pad, patches[0].shape[1]))
        positions.append(positions[0].new_zeros(num_pad, 3))
        index.append(torch.full((num_pad,), len(latents) - 1, dtype=torch.long, device=latents[0].device))
    per_token = None
    if token_timesteps is not None:
        if [t.numel() for t in token_timesteps] != [p.shape[0] for p in patches[: len(latents)]]:
            raise ValueError(f"token timesteps of {[t.numel() for t in token_timesteps]} tokens for samples of "
                             f"{[p.shape[0] for p in patches[: len(latents)]]}")
        per_token = torch.cat([t.flatten().to(timesteps) for t in token_timesteps] + [timesteps[-1:].expand(num_pad)])
    return PackedBatch(
        patches=torch.cat(patches),
        positions=torch.cat(positions),
        sample_index=torch.cat(index),
        grids=grids,
        timesteps=timesteps,
        text=text,
        num_pad=num_pad,
        image=image,
        token_timesteps=per_token,
        text_lengths=None if text_lengths is None else torch.tensor(list(text_lengths), dtype=torch.long),
    )


def pack_targets(targets: Sequence[torch.Tensor], patch: Sequence[int], num_pad: int = 0) -> torch.Tensor:
    """Per-sample targets ``[C, F, H, W]`` as packed output tokens (padding rows zero)."""
    rows = [patchify_output(t, patch) for t in targets]
    if num_pad:
        rows.append(rows[0].new_zeros(num_pad, rows[0].shape[1]))
    return torch.cat(rows)


def unpack_outputs(tokens: torch.Tensor, batch: PackedBatch, patch: Sequence[int]) -> list[torch.Tensor]:
    """Packed output tokens -> per-sample ``[C, F, H, W]`` (padding dropped)."""
    bounds = batch.sample_bounds
    return [unpatchify_output(tokens[a:b], g, patch) for a, b, g in zip(bounds[:-1], bounds[1:], batch.grids)]
