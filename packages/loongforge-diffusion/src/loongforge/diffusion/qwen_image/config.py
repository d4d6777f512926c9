"""The ``model`` config of the ``qwen_image`` family: diffusers' ``QwenImageTransformer2DModel``
field names, plus what the shared task reads (prompt length, pretrained weights)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from loongforge.core.balance import CostModel
from loongforge.diffusion.model.attention import BACKENDS
from loongforge.diffusion.model.family import DiTConfig

# QwenImageTransformer2DModel config fields this implementation reproduces exactly
DIFFUSERS_FIELDS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                    "num_attention_heads", "joint_attention_dim", "axes_dims_rope")
# fields of variants it does not reproduce (guidance distillation, Qwen-Image-Edit's zero-timestep
# condition images and their layered RoPE): they must keep these values
UNSUPPORTED_FIELDS = {"guidance_embeds": False, "zero_cond_t": False, "use_additional_t_cond": False,
                      "use_layer3d_rope": False}
CHECKPOINTING = ("none", "full")


@dataclass
class QwenImageConfig(DiTConfig):
    diffusers_class: ClassVar[str] = "QwenImageTransformer2DModel"

    family: str = "qwen_image"
    patch_size: int = 2  # spatial patch of the 2x2-packed latents (one latent frame per token row)
    in_channels: int = 16  # packed input width: latent channels x patch_size^2
    out_channels: int = 4  # latent channels predicted
    num_layers: int = 2  # double-stream blocks
    attention_head_dim: int = 32
    num_attention_heads: int = 2
    joint_attention_dim: int = 32  # width of the text encoder's prompt embeddings (Qwen2.5-VL: 3584)
    axes_dims_rope: list[int] = field(default_factory=lambda: [8, 12, 12])  # RoPE widths of (frame, row, column)
    attention_backend: str = "auto"

    def __post_init__(self):
        for key in ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
                    "num_attention_heads", "joint_attention_dim", "text_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.in_channels != self.out_channels * self.patch_size**2:
            raise ValueError(f"model.in_channels={self.in_channels} must be model.out_channels x model.patch_size^2 "
                             f"({self.out_channels * self.patch_size**2}): Qwen-Image reads 2x2-packed latents")
        axes = list(self.axes_dims_rope)
        if len(axes) != 3 or any(a < 2 or a % 2 for a in axes) or sum(axes) != self.attention_head_dim:
            raise ValueError(f"model.axes_dims_rope={axes}: three even widths summing to model.attention_head_dim "
                             f"({self.attention_head_dim})")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"model.attention_backend={self.attention_backend!r}: one of {', '.join(BACKENDS)}")

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch(self) -> tuple[int, int, int]:
        return (1, self.patch_size, self.patch_size)

    @property
    def latent_channels(self) -> int:
        return self.out_channels

    @property
    def text_width(self) -> int:
        return self.joint_attention_dim

    def part_names(self) -> list[str]:
        return ["transformer"]  # QwenImagePipeline's component

    def cost_model(self) -> CostModel:
        """Per layer, image and text tokens alike: q/k/v/o ``4 D^2`` and the feed-forward ``8 D^2``
        multiply-adds; joint attention over ``l + L`` tokens ``2 D (l + L)^2``; per token the patch
        embedding and output projection ``2 D C p^2``; per sample the prompt's embedding ``D L T``."""
        d, n, L = self.hidden_size, self.num_layers, self.text_len
        k = 3 * 2  # (forward + backward) * FLOPs per multiply-add
        a = k * n * 2 * d
        b = k * (n * (12 * d * d + 4 * d * L) + 2 * d * self.in_channels)
        c = k * (n * (12 * d * d * L + 2 * d * L * L) + L * self.joint_attention_dim * d)
        return CostModel(a=float(a), b=float(b), c=float(c))

    def model_config_dict(self) -> dict:
        return {**self.diffusers_kwargs(), "text_len": self.text_len}

    def describe(self) -> str:
        return f"qwen_image MMDiT ({self.num_layers} layers, hidden {self.hidden_size})"

    def diffusers_kwargs(self) -> dict:
        """Keyword arguments of an equivalent ``QwenImageTransformer2DModel``."""
        out = {k: getattr(self, k) for k in DIFFUSERS_FIELDS}
        out["axes_dims_rope"] = tuple(self.axes_dims_rope)
        return out

    @classmethod
    def from_diffusers(cls, config: dict, source: str = "diffusers config", **overrides) -> "QwenImageConfig":
        """A QwenImageConfig from a ``QwenImageTransformer2DModel`` config dict (its config.json)."""
        for key, value in UNSUPPORTED_FIELDS.items():
            if config.get(key, value) != value:
                raise ValueError(f"{source}: {key}={config[key]!r} is not supported (only {value!r})")
        values = {k: config[k] for k in DIFFUSERS_FIELDS if k in config}
        if "axes_dims_rope" in values:
            values["axes_dims_rope"] = list(values["axes_dims_rope"])
        if values.get("out_channels") is None and "in_channels" in values:  # diffusers: out_channels or in_channels
            values["out_channels"] = values["in_channels"]
        return cls(**{**values, **overrides})
