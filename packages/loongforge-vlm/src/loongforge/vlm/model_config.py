"""Architecture configs of a VLM's parts: the vision encoder, the projector, and how vision
tokens are positioned in the foundation (an LLM family's ``GPTConfig`` from loongforge-llm).

Each part is its own YAML config group (``encoder/``, ``projector/``, ``foundation/``), so a
VLM is a composition and swapping one part is a one-line change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENCODER_KINDS = ("qwen2_5_vit", "siglip_vit")
PROJECTOR_KINDS = ("patch_merge_mlp", "mlp")


@dataclass
class EncoderConfig:
    """A ViT over patch sequences.

    ``qwen2_5_vit``: linear patch embedding of ``temporal_patch_size`` frames x
    ``patch_size``² pixels, 2D rotary positions (height, width), RMSNorm, SwiGLU, window
    attention in every layer but ``full_attention_layers`` (full attention within one frame).
    ``siglip_vit``: single-frame patches, learned absolute positions over a
    ``image_size / patch_size`` grid (resampled for other grids), LayerNorm, GELU MLP, a final
    LayerNorm, full attention within one frame.

    Patches of one LLM token (``spatial_merge_size``² neighbours) are consecutive in the
    patch sequence, so the projector can merge them with a reshape.
    """

    kind: str = "qwen2_5_vit"
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 2
    ffn_hidden_size: int = 64
    in_channels: int = 3
    patch_size: int = 8
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 32  # qwen2_5_vit: attention window side in pixels (0: no windows)
    full_attention_layers: list[int] = field(default_factory=lambda: [1])  # qwen2_5_vit, 0-based
    rope_theta: float = 10000.0  # qwen2_5_vit
    image_size: int = 64  # siglip_vit: the learned position grid covers image_size x image_size pixels
    norm_epsilon: float = 1e-6
    init_method_std: float = 0.02

    def __post_init__(self):
        if self.kind not in ENCODER_KINDS:
            raise ValueError(f"encoder.kind={self.kind!r}: one of {', '.join(ENCODER_KINDS)}")
        for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "in_channels",
                    "patch_size", "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"encoder.{key}={getattr(self, key)}: must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"encoder.hidden_size={self.hidden_size} is not divisible by "
                             f"encoder.num_attention_heads={self.num_attention_heads}")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"encoder.full_attention_layers={self.full_attention_layers}: {bad} outside 0..{self.num_layers - 1}")
        if self.kind == "qwen2_5_vit":
            if self.head_dim % 4:
                raise ValueError(f"encoder head dim {self.head_dim} (hidden_size/num_attention_heads) must be a "
                                 f"multiple of 4 for 2D rotary positions")
            unit = self.patch_size * self.spatial_merge_size
            if self.window_size < 0 or self.window_size % unit:
                raise ValueError(f"encoder.window_size={self.window_size} must be a non-negative multiple of "
                                 f"patch_size*spatial_merge_size = {unit}")
        else:
            if self.temporal_patch_size != 1:
                raise ValueError(f"encoder.temporal_patch_size={self.temporal_patch_size}: siglip_vit embeds single frames (1)")
            if self.image_size % self.patch_size:
                raise ValueError(f"encoder.image_size={self.image_size} is not a multiple of encoder.patch_size={self.patch_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch (channels x frames x pixels)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def uses_windows(self) -> bool:
        return self.kind == "qwen2_5_vit" and self.window_size > 0

    @property
    def position_grid(self) -> int:
        """siglip_vit: the side of the learned position grid, in patches."""
        return self.image_size // self.patch_size

    def parameter_count(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        gated = self.kind == "qwen2_5_vit"
        attn = 4 * h * h + 4 * h
        mlp = (3 if gated else 2) * h * f + (2 * f if gated else f) + h
        norms = (2 if gated else 4) * h
        embed = self.patch_dim * h + (0 if gated else h + self.position_grid ** 2 * h)
        final = 0 if gated else 2 * h
        return self.num_layers * (attn + mlp + norms) + embed + final

    def flops_per_patch(self) -> float:
        """Training FLOPs (6 x matmul parameters) per patch; attention scores are left out
        (windows keep them small next to the projections)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        per_layer = 4 * h * h + (3 if self.kind == "qwen2_5_vit" else 2) * h * f
        return 6.0 * (self.num_layers * per_layer + self.patch_dim * h)


@dataclass
class ProjectorConfig:
    """Vision features -> foundation embeddings; both kinds first concatenate the
    ``spatial_merge_size``² patches of one LLM token.

    ``patch_merge_mlp`` (Qwen2.5-VL's merger): norm of each patch, concatenate, Linear, GELU, Linear.
    ``mlp`` (LLaVA's ``mlp2x_gelu``): concatenate, Linear to the LLM width, GELU, Linear.
    """

    kind: str = "patch_merge_mlp"
    ffn_hidden_size: int | None = None  # default: encoder hidden x merge² (patch_merge_mlp), LLM hidden (mlp)
    norm: str = "rmsnorm"  # patch_merge_mlp: rmsnorm | layernorm
    norm_epsilon: float = 1e-6

    def __post_init__(self):
        if self.kind not in PROJECTOR_KINDS:
            raise ValueError(f"projector.kind={self.kind!r}: one of {', '.join(PROJECTOR_KINDS)}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"projector.norm={self.norm!r}: one of rmsnorm, layernorm")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"projector.ffn_hidden_size={self.ffn_hidden_size}: must be >= 1")


@dataclass
class VisionTokensConfig:
    """How vision tokens enter the foundation's sequence.

    ``rope: mrope`` gives every token a (temporal, height, width) position (Qwen2-VL's
    multimodal RoPE: text tokens have three equal components, a vision token its frame, row
    and column), rotating ``mrope_section`` frequency pairs by each component; ``rope: rope``
    keeps the foundation's 1D positions. ``tokens_per_second``: temporal positions of a video
    advance by this many per second of video.
    """

    rope: str = "mrope"
    mrope_section: list[int] | None = None  # default: head_dim/2 split 1/4, 3/8, 3/8 (Qwen2.5-VL's 16/24/24 of 64)
    tokens_per_second: float = 2.0
    image_token_id: int | None = None  # default: from the tokenizer
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    def __post_init__(self):
        if self.rope not in ("mrope", "rope"):
            raise ValueError(f"vision.rope={self.rope!r}: one of mrope, rope")
        if self.mrope_section is not None and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0):
            raise ValueError(f"vision.mrope_section={self.mrope_section}: three non-negative sizes (t, h, w)")

    def section_for(self, head_dim: int) -> list[int]:
        """The mrope section for a foundation with this head dim (checked to cover it)."""
        if self.mrope_section is None:
            half = head_dim // 2
            t = half // 4
            h = (half - t) // 2
            return [t, h, half - t - h]
        if sum(self.mrope_section) * 2 != head_dim:
            raise ValueError(f"vision.mrope_section={self.mrope_section} sums to {sum(self.mrope_section)}; the "
                             f"foundation's head dim {head_dim} needs {head_dim // 2}")
        return list(self.mrope_section)
