"""``plain_vit``: a ViT with fixed 2D sine-cosine positions (no learned table), LayerNorm, a GELU
MLP and a final LayerNorm, over single-frame patches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loongforge.core.models import ComponentSpec
from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.vit import VisionEncoder
from loongforge.vlm.model_config import EncoderConfig


@dataclass
class PlainViTConfig(EncoderConfig):
    family: str = "plain_vit"
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    max_period: float = 10000.0  # of the sine-cosine positions

    normalization = "LayerNorm"
    gated_mlp = False
    activation = "gelu_tanh"
    patch_bias = True
    post_norm = True

    def __post_init__(self):
        super().__post_init__()
        if self.hidden_size % 4:
            raise ValueError(f"encoder.hidden_size={self.hidden_size}: a multiple of 4 for 2D sine-cosine positions")


def sincos(positions: torch.Tensor, dim: int, max_period: float) -> torch.Tensor:
    """``[n, dim]`` sin/cos features of integer ``positions``."""
    freqs = torch.exp(-math.log(max_period) * torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))
    angles = positions.float()[:, None] * freqs.to(positions.device)[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class PlainViT(VisionEncoder):
    def embed(self, pixel_values, grid_thw):
        x = super().embed(pixel_values, grid_thw)
        rows, cols = geometry.patch_rows_cols(grid_thw, self.cfg.spatial_merge_size)
        half = self.cfg.hidden_size // 2
        pos = torch.cat([sincos(rows, half, self.cfg.max_period), sincos(cols, half, self.cfg.max_period)], dim=-1)
        return x + pos.to(x.dtype)


PLAIN_VIT = ComponentSpec(name="plain_vit", role="vision_encoder", config_class=PlainViTConfig, build=PlainViT)
