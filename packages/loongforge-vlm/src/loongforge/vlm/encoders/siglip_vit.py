"""SigLIP's vision transformer as a VLM component (``siglip_vit``): single-frame patches,
learned absolute positions over an ``image_size / patch_size`` grid (resampled bicubically for
other grids), LayerNorm, GELU MLP, a final LayerNorm, full attention within one frame."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loongforge.core.models import ComponentSpec
from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.vit import VisionEncoder
from loongforge.vlm.model_config import EncoderConfig


@dataclass
class SigLIPViTConfig(EncoderConfig):
    family: str = "siglip_vit"
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    image_size: int = 64  # the learned position grid covers image_size x image_size pixels

    normalization = "LayerNorm"
    gated_mlp = False
    activation = "gelu_tanh"
    patch_bias = True
    post_norm = True

    def __post_init__(self):
        super().__post_init__()
        if self.temporal_patch_size != 1:
            raise ValueError(f"encoder.temporal_patch_size={self.temporal_patch_size}: siglip_vit embeds single frames (1)")
        if self.image_size % self.patch_size:
            raise ValueError(f"encoder.image_size={self.image_size} is not a multiple of encoder.patch_size={self.patch_size}")

    @property
    def position_grid(self) -> int:
        """The side of the learned position grid, in patches."""
        return self.image_size // self.patch_size

    def extra_parameters(self) -> int:
        return self.position_grid ** 2 * self.hidden_size


class SigLIPViT(VisionEncoder):
    """SigLIP's vision transformer: learned absolute positions (resampled bicubically for grids
    other than the table's), LayerNorm, GELU MLP, final LayerNorm."""

    def __init__(self, cfg: SigLIPViTConfig, config, pg_collection):
        super().__init__(cfg, config, pg_collection)
        self.position_embedding = torch.nn.Parameter(
            torch.empty(cfg.position_grid ** 2, cfg.hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.position_embedding, std=cfg.init_method_std)

    def positions(self, h: int, w: int) -> torch.Tensor:
        g = self.cfg.position_grid
        table = self.position_embedding
        if (h, w) != (g, g):
            grid = table.reshape(g, g, -1).permute(2, 0, 1)[None].float()
            table = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)[0]
            table = table.permute(1, 2, 0).reshape(h * w, -1).to(self.position_embedding.dtype)
        rows, cols = geometry.block_major_hw(h, w, self.cfg.spatial_merge_size, table.device)
        return table[rows * w + cols]

    def embed(self, pixel_values, grid_thw):
        x = super().embed(pixel_values, grid_thw)
        pos = torch.cat([self.positions(h, w).repeat(t, 1) for t, h, w in grid_thw.tolist()])
        return x + pos


SIGLIP_VIT = ComponentSpec(name="siglip_vit", role="vision_encoder", config_class=SigLIPViTConfig, build=SigLIPViT)
