"""The vision transformer of Qwen2.5-VL as a VLM component (``qwen2_5_vit``): linear patch
embedding of ``temporal_patch_size`` frames x ``patch_size``² pixels, 2D rotary positions (row,
column), RMSNorm, SwiGLU, window attention in every layer but ``full_attention_layers`` (full
attention within one frame)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.core.models import ComponentSpec
from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.vit import VisionEncoder
from loongforge.vlm.model_config import EncoderConfig


@dataclass
class QwenViTConfig(EncoderConfig):
    family: str = "qwen2_5_vit"
    window_size: int = 32  # attention window side in pixels (0: no windows)
    full_attention_layers: list[int] = field(default_factory=lambda: [1])  # 0-based
    rope_theta: float = 10000.0  # base frequency of the 2-D vision RoPE

    normalization = "RMSNorm"
    gated_mlp = True
    activation = "silu"
    patch_bias = False

    def __post_init__(self):
        super().__post_init__()
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"encoder.full_attention_layers={self.full_attention_layers}: {bad} outside 0..{self.num_layers - 1}")
        if self.head_dim % 4:
            raise ValueError(f"encoder head dim {self.head_dim} (hidden_size/num_attention_heads) must be a "
                             f"multiple of 4 for 2D rotary positions")
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size < 0 or self.window_size % unit:
            raise ValueError(f"encoder.window_size={self.window_size} must be a non-negative multiple of "
                             f"patch_size*spatial_merge_size = {unit}")

    @property
    def uses_windows(self) -> bool:
        return self.window_size > 0

    @property
    def window_units(self) -> int:
        """A window's side in merged tokens."""
        return self.window_size // (self.spatial_merge_size * self.patch_size)

    def full_attention(self, layer: int) -> bool:
        return not self.uses_windows or layer in self.full_attention_layers


class QwenViT(VisionEncoder):
    """Qwen2.5-VL's vision transformer: 2D RoPE over (row, column), window attention."""

    def __init__(self, cfg: QwenViTConfig, config, pg_collection):
        super().__init__(cfg, config, pg_collection)
        self.register_buffer("inv_freq", geometry.axial_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    def rotary(self, grid_thw):
        return geometry.axial_rotary(grid_thw, self.cfg.spatial_merge_size, self.inv_freq)


QWEN2_5_VIT = ComponentSpec(name="qwen2_5_vit", role="vision_encoder", config_class=QwenViTConfig, build=QwenViT)
