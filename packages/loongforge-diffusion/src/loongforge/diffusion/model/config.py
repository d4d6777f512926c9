"""The ``model`` config group: Wan DiT architecture (diffusers' ``WanTransformer3DModel`` field
names) plus how LoongForge runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from loongforge.core.balance import CostModel
from loongforge.diffusion.model.attention import BACKENDS
from loongforge.diffusion.model.family import DiTConfig

# diffusers WanTransformer3DModel config fields this implementation reproduces exactly
DIFFUSERS_FIELDS = (
    "patch_size",
    "num_attention_heads",
    "attention_head_dim",
    "in_channels",
    "out_channels",
    "text_dim",
    "freq_dim",
    "ffn_dim",
    "num_layers",
    "cross_attn_norm",
    "qk_norm",
    "eps",
    "rope_max_seq_len",
    "image_dim",
    "added_kv_proj_dim",
)
# the parts of a Wan model, named as in diffusers' WanPipeline: one DiT, or Wan 2.2's two experts
# (high-noise, low-noise)
EXPERT_NAMES = ("transformer", "transformer_2")
IMAGE_TOKENS = 257  # CLIP ViT-H/14 tokens of a 224x224 image (Wan 2.1 I2V's image encoder)
# diffusers fields of variants this implementation does not reproduce (Wan 2.1 FLF2V's image
# position embedding); they must be unset
UNSUPPORTED_FIELDS = ("pos_embed_seq_len",)
# how a video is conditioned on an image (its first frame): none (text-to-video); i2v (Wan 2.1 /
# 2.2 I2V: a first-frame mask and the VAE latents of the image followed by blank frames are
# concatenated to the noisy latent on channels, plus, with image_dim, CLIP image tokens read by
# the cross-attention); ti2v (Wan 2.2 TI2V: the first latent frame is the clean image latent,
# with timestep 0 for its tokens)
CONDITIONS = ("none", "i2v", "ti2v")
# per-block activation recomputation (train.recompute): nothing, the whole block, or the
# elementwise work between the kept attention and GEMM outputs
CHECKPOINTING = ("none", "full", "selective")
EXPERT_CHOICES = ("all", "transformer", "transformer_2")
# FP8 GEMMs of the blocks' token linears (loongforge.diffusion.ops.fp8_tensorwise)
FP8_MODES = ("none", "tensorwise")


@dataclass
class WanConfig(DiTConfig):
    context_parallel: ClassVar[bool] = True
    diffusers_class: ClassVar[str] = "WanTransformer3DModel"
    compile_on_cuda: ClassVar[bool] = True

    # architecture (diffusers names and meanings)
    patch_size: list[int] = field(default_factory=lambda: [1, 2, 2])
    num_attention_heads: int = 2  # attention heads per block
    attention_head_dim: int = 32  # width of one head (hidden size = heads * head dim)
    in_channels: int = 4  # latent channels in (with image conditioning: the concatenated condition channels too)
    out_channels: int = 4  # latent channels predicted
    text_dim: int = 32  # width of the text encoder's prompt embeddings
    freq_dim: int = 32  # width of the sinusoidal timestep embedding
    ffn_dim: int = 128  # hidden width of each block's feed-forward
    num_layers: int = 2  # transformer blocks
    cross_attn_norm: bool = True  # a LayerNorm before the cross-attention on the prompt
    qk_norm: str = "rms_norm_across_heads"  # query/key normalisation (diffusers' name: rms_norm_across_heads)
    eps: float = 1e-6  # epsilon of the norms
    rope_max_seq_len: int = 1024  # positions of the 3-D RoPE table per axis
    # Wan 2.1 I2V: width of the CLIP image tokens (1280; the image embedder maps them to the hidden
    # size); null for every other variant
    image_dim: int | None = None
    # Wan 2.1 I2V: input width of the cross-attention's key/value projections of the image tokens
    # (the hidden size); null exactly when image_dim is
    added_kv_proj_dim: int | None = None
    # none | i2v | ti2v: how videos are conditioned on an image (their first frame). i2v (Wan 2.1/2.2
    # I2V): first-frame mask and condition latents concatenated on channels, in_channels =
    # 2 * out_channels + the VAE's temporal factor; ti2v (Wan 2.2 TI2V): the first latent frame given
    # at timestep 0 and left out of the loss, in_channels = out_channels, a temporal patch of 1
    condition: str = "none"
    # Wan 2.2 two experts: timesteps >= boundary_ratio * 1000 go to the high-noise expert
    boundary_ratio: float | None = None
    # how it runs
    attention_backend: str = "auto"
    # none | tensorwise: the blocks' linears over video tokens (attention projections, feed-forward)
    # run their three GEMMs in FP8 with one scale per tensor (CUDA sm_89+); prompt projections,
    # embedders and the output head stay in the autocast dtype
    fp8: str = "none"
    # which Wan 2.2 expert(s) to train: all (one per step, chosen by the timestep density) or one
    train_expert: str = "all"

    def __post_init__(self):
        if len(self.patch_size) != 3 or any(p < 1 for p in self.patch_size):
            raise ValueError(f"model.patch_size={list(self.patch_size)}: three positive ints (t, h, w)")
        for key in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                    "freq_dim", "ffn_dim", "num_layers", "rope_max_seq_len", "text_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.attention_head_dim % 2 or (self.attention_head_dim - 4 * (self.attention_head_dim // 6)) % 2:
            raise ValueError(f"model.attention_head_dim={self.attention_head_dim}: its 3D RoPE bands must be even")
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(f"model.qk_norm={self.qk_norm!r}: only 'rms_norm_across_heads' (Wan) is supported")
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(f"model.boundary_ratio={self.boundary_ratio}: must be in (0, 1) or null")
        self._check_condition()
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"model.attention_backend={self.attention_backend!r}: one of {', '.join(BACKENDS)}")
        if self.train_expert not in EXPERT_CHOICES:
            raise ValueError(f"model.train_expert={self.train_expert!r}: one of {', '.join(EXPERT_CHOICES)}")
        if self.fp8 not in FP8_MODES:
            raise ValueError(f"model.fp8={self.fp8!r}: one of {', '.join(FP8_MODES)}")
        if self.fp8 != "none" and (self.hidden_size % 16 or self.ffn_dim % 16):
            raise ValueError(
                f"model.fp8={self.fp8!r} needs model.num_attention_heads x model.attention_head_dim "
                f"({self.hidden_size}) and model.ffn_dim ({self.ffn_dim}) to be multiples of 16 (FP8 GEMM shapes)"
            )

    def _check_condition(self) -> None:
        if self.condition not in CONDITIONS:
            raise ValueError(f"model.condition={self.condition!r}: one of {', '.join(CONDITIONS)}")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError(f"model.image_dim={self.image_dim} and model.added_kv_proj_dim={self.added_kv_proj_dim}: "
                             f"set both (Wan 2.1 I2V image tokens) or neither")
        if self.image_dim is not None:
            if self.image_dim < 1:
                raise ValueError(f"model.image_dim={self.image_dim}: must be >= 1")
            if self.added_kv_proj_dim != self.hidden_size:
                raise ValueError(f"model.added_kv_proj_dim={self.added_kv_proj_dim}: must be the hidden size "
                                 f"model.num_attention_heads x model.attention_head_dim ({self.hidden_size})")
            if self.condition != "i2v":
                raise ValueError(f"model.image_dim={self.image_dim} needs model.condition='i2v' "
                                 f"(got {self.condition!r})")
        if self.condition == "i2v":
            if self.mask_channels < 1:
                raise ValueError(f"model.condition='i2v' needs model.in_channels ({self.in_channels}) = 2 x "
                                 f"model.out_channels ({self.out_channels}) + the mask channels (the VAE's "
                                 f"temporal factor, 4 for Wan)")
        elif self.in_channels != self.out_channels:
            raise ValueError(f"model.in_channels={self.in_channels} != model.out_channels={self.out_channels} "
                             f"needs model.condition='i2v' (got {self.condition!r})")
        if self.condition == "ti2v" and self.patch_size[0] != 1:
            raise ValueError(f"model.condition='ti2v' needs a temporal patch of 1 (model.patch_size="
                             f"{list(self.patch_size)}): the first latent frame is whole tokens")

    @property
    def mask_channels(self) -> int:
        """I2V: channels of the first-frame mask between the noisy and the condition latents."""
        return self.in_channels - 2 * self.out_channels if self.condition == "i2v" else 0

    def check_device(self, device_type: str) -> None:
        """Settings the device cannot run, as a config error (call before any process group)."""
        if self.fp8 == "none" or device_type != "cuda":
            return
        name = torch.cuda.get_device_name()
        if torch.version.hip is not None:
            raise ValueError(f"model.fp8={self.fp8!r} runs on NVIDIA GPUs (e4m3fn/e5m2 _scaled_mm); {name} is a ROCm device")
        if torch.cuda.get_device_capability() < (8, 9):
            raise ValueError(f"model.fp8={self.fp8!r} needs FP8 tensor cores (CUDA compute capability 8.9+); {name} has none")

    @property
    def patch(self) -> tuple[int, int, int]:
        pt, ph, pw = self.patch_size
        return pt, ph, pw

    @property
    def latent_channels(self) -> int:
        return self.out_channels

    @property
    def text_width(self) -> int:
        return self.text_dim

    def part_names(self) -> list[str]:
        """One DiT, ``transformer``, or Wan 2.2's two experts (``transformer``, ``transformer_2``)."""
        return list(EXPERT_NAMES[: 2 if self.boundary_ratio is not None else 1])

    def cost_model(self) -> CostModel:
        """Training FLOPs of one sample of ``l`` tokens (matmuls, 2 FLOPs per multiply-add, backward
        = 2x forward): ``a * l**2 + b * l + c``.

        Per layer and token: self-attention q/k/v/o ``4 D^2``, cross-attention q/o ``2 D^2`` and scores
        over the prompt ``2 D L``, feed-forward ``2 D F``; per segment: self-attention scores and
        weighted sum ``2 D l^2``; per sample: cross-attention k/v of the prompt ``2 D^2 L``; once per
        token: patch embedding and output projection ``2 D C p``. Wan 2.1 I2V's image tokens count as
        prompt tokens (their keys/values and scores; ``IMAGE_TOKENS``, CLIP ViT-H's 257).
        """
        d, n, f = self.hidden_size, self.num_layers, self.ffn_dim
        L = self.text_len + (IMAGE_TOKENS if self.image_dim else 0)  # I2V: a second attention over image tokens
        p = self.patch_volume
        k = 3 * 2  # (forward + backward) * FLOPs per multiply-add
        a = k * n * 2 * d
        b = k * (n * (6 * d * d + 2 * d * L + 2 * d * f) + d * p * (self.in_channels + self.out_channels))
        c = k * n * 2 * d * d * L
        return CostModel(a=float(a), b=float(b), c=float(c))

    def model_config_dict(self) -> dict:
        return {**self.diffusers_kwargs(), "patch_size": list(self.patch_size), "text_len": self.text_len,
                "boundary_ratio": self.boundary_ratio, "condition": self.condition}

    def describe(self) -> str:
        return (f"wan DiT ({self.num_layers} layers, hidden {self.hidden_size}, "
                f"experts {'+'.join(self.part_names())})")

    def check_recipe(self, recipe) -> None:
        super().check_recipe(recipe)
        if self.num_attention_heads % recipe.parallel.cp:
            raise ValueError(
                f"parallel.cp={recipe.parallel.cp} must divide model.num_attention_heads={self.num_attention_heads} "
                "(Ulysses splits heads)"
            )
        if self.train_expert != "all" and self.boundary_ratio is None:
            raise ValueError(f"model.train_expert={self.train_expert!r} needs two experts (set model.boundary_ratio)")

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw

    def diffusers_kwargs(self) -> dict:
        """Keyword arguments of an equivalent ``WanTransformer3DModel``."""
        out = {k: getattr(self, k) for k in DIFFUSERS_FIELDS}
        out["patch_size"] = tuple(self.patch_size)
        return out

    @classmethod
    def from_diffusers(cls, config: dict, source: str = "diffusers config", **overrides) -> "WanConfig":
        """A WanConfig from a ``WanTransformer3DModel`` config dict (e.g. its config.json)."""
        for key in UNSUPPORTED_FIELDS:
            if config.get(key) is not None:
                raise ValueError(f"{source}: {key}={config[key]!r} (Wan first-last-frame image positions) is not supported")
        values = {k: config[k] for k in DIFFUSERS_FIELDS if k in config}
        if "patch_size" in values:
            values["patch_size"] = list(values["patch_size"])
        if values.get("qk_norm") is None:
            values.pop("qk_norm", None)
        if values.get("out_channels") is None and "in_channels" in values:  # diffusers: out_channels or in_channels
            values["out_channels"] = values["in_channels"]
        if values.get("in_channels", cls.in_channels) != values.get("out_channels", cls.out_channels):
            values["condition"] = "i2v"  # noisy + mask + condition latents on channels
        return cls(**{**values, **overrides})
