"""The vision transformer of Qwen3-VL as a VLM component (``qwen3_vit``): linear patch embedding
(with bias) of ``temporal_patch_size`` frames x ``patch_size``² pixels, a learned table of
``num_position_embeddings`` absolute positions (a square grid, resampled bilinearly with aligned
corners to each frame's grid) added to it, 2D rotary positions (row, column) as Qwen2.5-VL's,
LayerNorm, a GELU (tanh) MLP, full attention within each frame and no final norm.

``deepstack_layers`` are the layers whose outputs DeepStack adds to the foundation's first
hidden states (each through a patch merger of its own; see ``loongforge.vlm.deepstack``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loongforge.core.models import ComponentSpec
from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.position_table import new_position_table, packed_positions
from loongforge.vlm.encoders.vit import VisionEncoder
from loongforge.vlm.model_config import EncoderConfig


@dataclass
class Qwen3ViTConfig(EncoderConfig):
    family: str = "qwen3_vit"
    num_position_embeddings: int = 16  # a square number: the learned grid is its root on a side
    deepstack_layers: list[int] = field(default_factory=lambda: [0])  # 0-based, increasing; DeepStack feature k joins after foundation layer k
    rope_theta: float = 10000.0  # base frequency of the 2-D vision RoPE

    normalization = "LayerNorm"
    gated_mlp = False
    activation = "gelu_tanh"
    patch_bias = True
    post_norm = False

    def __post_init__(self):
        super().__post_init__()
        side = math.isqrt(self.num_position_embeddings)
        if self.num_position_embeddings < 1 or side * side != self.num_position_embeddings:
            raise ValueError(f"encoder.num_position_embeddings={self.num_position_embeddings}: must be a square number")
        layers = list(self.deepstack_layers)
        if layers != sorted(set(layers)) or any(not 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"encoder.deepstack_layers={layers}: increasing layer indices in 0..{self.num_layers - 1}")
        if self.head_dim % 4:
            raise ValueError(f"encoder head dim {self.head_dim} (hidden_size/num_attention_heads) must be a "
                             f"multiple of 4 for 2D rotary positions")

    def deepstack_indices(self) -> tuple[int, ...]:
        return tuple(self.deepstack_layers)

    @property
    def position_grid(self) -> int:
        """The side of the learned position grid, in patches."""
        return math.isqrt(self.num_position_embeddings)

    def extra_parameters(self) -> int:
        return self.num_position_embeddings * self.hidden_size


class Qwen3ViT(VisionEncoder):
    """Qwen3-VL's vision transformer: learned positions (bilinear, aligned corners) plus 2D RoPE."""

    def __init__(self, cfg: Qwen3ViTConfig, config, pg_collection):
        super().__init__(cfg, config, pg_collection)
        self.position_embedding = new_position_table(cfg.num_position_embeddings, cfg.hidden_size,
                                                     cfg.init_method_std, config.params_dtype)
        self.register_buffer("inv_freq", geometry.axial_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def embed(self, pixel_values, grid_thw):
        x = super().embed(pixel_values, grid_thw)
        return x + packed_positions(self.position_embedding, self.cfg.position_grid, grid_thw,
                                    self.cfg.spatial_merge_size, "bilinear", align_corners=True)

    def rotary(self, grid_thw):
        return geometry.axial_rotary(grid_thw, self.cfg.spatial_merge_size, self.inv_freq)


QWEN3_VIT = ComponentSpec(name="qwen3_vit", role="vision_encoder", config_class=Qwen3ViTConfig, build=Qwen3ViT)
