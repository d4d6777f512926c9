"""Wan's 3D rotary position embedding for packed tokens.

Wan splits each head's channels into (frame, height, width) bands of sizes
``(hd - 2*(2*(hd//6)), 2*(hd//6), 2*(hd//6))`` and rotates channel pairs ``(2i, 2i+1)`` of each band
by ``pos * theta**(-2i/band)`` (diffusers' ``WanRotaryPosEmbed``, interleaved pairs). The tables
here hold one angle per pair and token; the registry op ``qk_norm_rope`` (``loongforge.diffusion.ops``)
rotates with them.
"""

from __future__ import annotations

import torch


def band_sizes(head_dim: int) -> tuple[int, int, int]:
    """Channels per head given to the (frame, height, width) axes, as in diffusers."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def _angles(positions: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)[: dim // 2] / dim))
    return positions.to(torch.float64)[:, None] * freqs[None, :]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of shape ``[tokens, head_dim / 2]`` (fp32; column ``i`` rotates channels
    ``(2i, 2i+1)`` of every head) for token grid positions ``[tokens, 3]`` (frame, row, column
    index inside each sample)."""
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"positions must be [tokens, 3], got {list(positions.shape)}")
    angles = torch.cat(
        [_angles(positions[:, axis], dim, theta) for axis, dim in enumerate(band_sizes(head_dim))], dim=1
    )
    return angles.cos().float(), angles.sin().float()
