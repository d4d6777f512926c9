"""SigLIP's vision transformer as a VLM component (``siglip_vit``): single-frame patches,
learned absolute positions over an ``image_size / patch_size`` grid (resampled bicubically for
other grids), LayerNorm, GELU MLP, a final LayerNorm (``post_norm``: SigLIP's ``post_layernorm``;
off for LLaVA-OneVision's tower, whose projector reads the last layer before it), full attention
within one frame. ``init_from_hf``: a SigLIP or LLaVA-OneVision Hugging Face directory whose vision
tower the encoder starts from (``loongforge.vlm.hf_siglip``)."""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.core.models import ComponentSpec
from loongforge.vlm.encoders.position_table import new_position_table, packed_positions
from loongforge.vlm.encoders.vit import VisionEncoder
from loongforge.vlm.model_config import EncoderConfig


@dataclass
class SigLIPViTConfig(EncoderConfig):
    family: str = "siglip_vit"
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    image_size: int = 64  # the learned position grid covers image_size x image_size pixels
    post_norm: bool = True  # a final LayerNorm after the last layer (SigLIP's post_layernorm)
    # a SigLIP (SiglipModel/SiglipVisionModel) or LLaVA-OneVision HF directory (or hub id): the tower's
    # weights at training start; the encoder's architecture keys must be the directory's
    init_from_hf: str | None = None

    normalization = "LayerNorm"
    gated_mlp = False
    activation = "gelu_tanh"
    patch_bias = True

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
        self.position_embedding = new_position_table(cfg.position_grid ** 2, cfg.hidden_size, cfg.init_method_std,
                                                     config.params_dtype)

    def embed(self, pixel_values, grid_thw):
        x = super().embed(pixel_values, grid_thw)
        return x + packed_positions(self.position_embedding, self.cfg.position_grid, grid_thw,
                                    self.cfg.spatial_merge_size, "bicubic", align_corners=False)


SIGLIP_VIT = ComponentSpec(name="siglip_vit", role="vision_encoder", config_class=SigLIPViTConfig, build=SigLIPViT)
