"""The vision encoders: a megatron-core ``TransformerBlock`` over the packed patches of all
images and videos of a micro-batch, returning one feature per patch in input order.

The patch embedding (a linear map of flattened patches, the same as a convolution with stride
equal to its kernel) and SigLIP's position table are plain torch modules: they are small and
replicated on every TP rank, and megatron has no module that embeds pre-flattened patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.attention import segment_ids
from loongforge.vlm.encoders.layers import init_linear_, vit_block_spec
from loongforge.vlm.model_config import EncoderConfig


class VisionEncoder(MegatronModule):
    """Shared machinery: patch embedding, the block, the segmentations."""

    post_norm = False  # a final norm after the last layer

    def __init__(self, cfg: EncoderConfig, config, pg_collection, bias: bool):
        super().__init__(config=config)
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.cfg = cfg
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.patch_embed = torch.nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=bias, dtype=config.params_dtype)
        init_linear_(self.patch_embed, cfg.init_method_std)
        self.decoder = TransformerBlock(config=config, spec=vit_block_spec(cfg), post_layer_norm=self.post_norm,
                                        pg_collection=pg_collection)

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))

    def rotary(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        return None

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values [patches, patch_dim]`` of items with grids ``grid_thw [n, 3]`` ->
        ``[patches, hidden]``."""
        total = pixel_values.shape[0]
        if sum(geometry.patch_counts(grid_thw)) != total:
            raise ValueError(f"grid_thw {grid_thw.tolist()} describes {sum(geometry.patch_counts(grid_thw))} "
                             f"patches, pixel_values has {total}")
        x = self.embed(pixel_values, grid_thw)
        rot = self.rotary(grid_thw)
        frames = segment_ids(geometry.frame_cu_seqlens(grid_thw), total)
        perm = None
        if self.cfg.uses_windows:
            m = self.cfg.spatial_merge_size
            units, lengths = geometry.window_order(grid_thw, m, self.cfg.window_size // (m * self.cfg.patch_size))
            perm = geometry.expand_units(units, m)
            x, frames = x[perm], frames[perm]
            rot = rot[perm] if rot is not None else None
            windows = segment_ids(torch.nn.functional.pad(lengths.cumsum(0), (1, 0)), total)
        else:
            windows = frames
        segments = torch.stack([frames, windows])
        out = self.decoder(x[:, None, :], attention_mask=segments,
                           rotary_pos_emb=rot[:, None, None, :] if rot is not None else None)[:, 0]
        if perm is not None:
            out = out[torch.argsort(perm)]
        return out


class QwenViT(VisionEncoder):
    """Qwen2.5-VL's vision transformer: 2D RoPE over (row, column), window attention."""

    def __init__(self, cfg: EncoderConfig, config, pg_collection):
        super().__init__(cfg, config, pg_collection, bias=False)
        quarter = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotary(self, grid_thw):
        rows, cols = geometry.patch_rows_cols(grid_thw, self.cfg.spatial_merge_size)
        inv = self.inv_freq.to(grid_thw.device, torch.float32)
        angles = torch.cat([rows[:, None].float() * inv, cols[:, None].float() * inv], dim=-1)
        return torch.cat([angles, angles], dim=-1)  # rotate-half layout over the whole head dim


class SigLIPViT(VisionEncoder):
    """SigLIP's vision transformer: learned absolute positions (resampled bicubically for grids
    other than the table's), LayerNorm, GELU MLP, final LayerNorm."""

    post_norm = True

    def __init__(self, cfg: EncoderConfig, config, pg_collection):
        super().__init__(cfg, config, pg_collection, bias=True)
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


ENCODERS = {"qwen2_5_vit": QwenViT, "siglip_vit": SigLIPViT}


def build_encoder(cfg: EncoderConfig, config, pg_collection) -> VisionEncoder:
    return ENCODERS[cfg.kind](cfg, config, pg_collection)
