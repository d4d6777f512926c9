"""InternVL's vision transformer (InternViT) as a VLM component (``internvit``): each image tile is
one frame of ``patch_size``² patches (no temporal patches) embedded linearly (with bias); a
learned CLS token is prepended to every frame and dropped after the last layer (transformers'
``vision_feature_select_strategy="default"``); learned absolute positions (the CLS token's, then
an ``image_size / patch_size`` square grid, resampled bicubically for other grids) are added;
pre-norm layers (LayerNorm or RMSNorm) with layer scale on both residual branches, an optional
query/key RMSNorm over all heads (``qk_norm``), an exact-GELU MLP and full attention within each
tile; an optional final LayerNorm (``post_norm``: transformers' ``use_mean_pooling=False``).

Patches are laid out block-major with ``spatial_merge_size`` 2, so the four patches of one 2x2
block are consecutive: the projector's merge of them is InternVL's pixel shuffle (ratio 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge.core.models import ComponentSpec
from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.attention import segment_ids
from loongforge.vlm.encoders.position_table import packed_positions
from loongforge.vlm.encoders.vit import VisionEncoder
from loongforge.vlm.model_config import EncoderConfig

NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass
class InternViTConfig(EncoderConfig):
    family: str = "internvit"
    patch_size: int = 8
    temporal_patch_size: int = 1
    spatial_merge_size: int = 2  # pixel shuffle with ratio 0.5: the 2x2 patches of one LLM token
    image_size: int = 32  # a tile's side in pixels; the learned position grid is image_size / patch_size on a side
    norm: str = "layernorm"  # layernorm | rmsnorm (the layers' norms)
    qkv_bias: bool = True  # the query/key/value projections have biases
    qk_norm: bool = False  # an RMSNorm of queries and keys over all heads together (InternViT-6B)
    layer_scale_init: float = 0.1  # the initial value of the layer-scale factors (lambda_1, lambda_2)
    post_norm: bool = False  # a final LayerNorm after the last layer

    gated_mlp = False
    activation = "gelu"
    patch_bias = True
    layer_scale = True

    def __post_init__(self):
        super().__post_init__()
        if self.temporal_patch_size != 1:
            raise ValueError(f"encoder.temporal_patch_size={self.temporal_patch_size}: internvit embeds single frames (1)")
        if self.norm not in NORMS:
            raise ValueError(f"encoder.norm={self.norm!r}: one of {', '.join(NORMS)}")
        if self.post_norm and self.norm != "layernorm":
            raise ValueError(f"encoder.post_norm=true with encoder.norm={self.norm!r}: InternViT's final norm is a "
                             f"LayerNorm, so the layers must use layernorm too")
        grid = self.image_size // self.patch_size
        if self.image_size % self.patch_size or grid % self.spatial_merge_size:
            raise ValueError(f"encoder.image_size={self.image_size}: must be a multiple of encoder.patch_size="
                             f"{self.patch_size} x encoder.spatial_merge_size={self.spatial_merge_size}")

    @property
    def normalization(self) -> str:
        return NORMS[self.norm]

    @property
    def position_grid(self) -> int:
        """The side of the learned position grid, in patches."""
        return self.image_size // self.patch_size

    def extra_parameters(self) -> int:
        return (self.position_grid ** 2 + 2) * self.hidden_size  # positions (the CLS token's too), the CLS token


class InternViT(VisionEncoder):
    """InternViT: a CLS token per tile, learned positions (bicubic), layer scale."""

    def __init__(self, cfg: InternViTConfig, config, pg_collection):
        super().__init__(cfg, config, pg_collection)
        h, std = cfg.hidden_size, cfg.init_method_std
        # shaped as transformers' (the CLS token's position first)
        self.cls_token = torch.nn.Parameter(torch.empty(1, 1, h, dtype=config.params_dtype))
        self.position_embedding = torch.nn.Parameter(torch.empty(1, cfg.position_grid ** 2 + 1, h,
                                                                 dtype=config.params_dtype))
        for p in (self.cls_token, self.position_embedding):
            torch.nn.init.normal_(p, std=std)

    def embed(self, pixel_values, grid_thw):
        x = super().embed(pixel_values, grid_thw)
        return x + packed_positions(self.position_embedding[0, 1:], self.cfg.position_grid, grid_thw,
                                    self.cfg.spatial_merge_size, "bicubic", align_corners=False)

    def features(self, pixel_values, grid_thw, layers=()):
        """The patches' features (CLS tokens dropped) and those of ``layers``, in input order."""
        total = self.check_patches(pixel_values, grid_thw)
        patches = self.embed(pixel_values, grid_thw)
        bounds = geometry.frame_cu_seqlens(grid_thw)
        frames = bounds.numel() - 1
        frame_of_patch = segment_ids(bounds, total)
        # slots in the sequence with a CLS token in front of every frame
        patch_slots = torch.arange(total, device=patches.device) + frame_of_patch.to(patches.device) + 1
        cls_slots = bounds[:-1].to(patches.device) + torch.arange(frames, device=patches.device)
        source = torch.empty(total + frames, dtype=torch.long, device=patches.device)
        source[patch_slots] = torch.arange(total, device=patches.device)
        source[cls_slots] = total + torch.arange(frames, device=patches.device)
        cls = (self.cls_token[0] + self.position_embedding[0, :1]).to(patches.dtype).expand(frames, -1)
        x = torch.cat([patches, cls])[source]
        lengths = (bounds[1:] - bounds[:-1] + 1).to(patches.device)
        segments = torch.repeat_interleave(torch.arange(frames, device=patches.device), lengths)
        outputs = self.run_block(x, torch.stack([segments, segments]), None, layers)
        return outputs[0][patch_slots], [t[patch_slots] for t in outputs[1:]]


INTERNVIT = ComponentSpec(name="internvit", role="vision_encoder", config_class=InternViTConfig, build=InternViT)
