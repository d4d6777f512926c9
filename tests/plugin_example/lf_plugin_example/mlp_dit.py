"""``mlp_dit``: a small diffusion transformer without attention. Each packed patch token is
embedded, modulated by its sample's timestep and mean-pooled prompt (adaLN) through residual MLP
blocks, and projected to its velocity; the shared flow-matching task of ``lf-diffusion`` trains it
on the same latent shards as Wan."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loongforge.core.balance import CostModel
from loongforge.core.models import ModelSpec
from loongforge.core.training.torch_model import TorchModel
from loongforge.diffusion.model.family import DiTConfig
from loongforge.diffusion.packing import PackedBatch


@dataclass
class MLPDiTConfig(DiTConfig):
    family: str = "mlp_dit"
    channels: int = 4  # latent channels
    text_dim: int = 32  # prompt embedding width
    patch_size: int = 2  # spatial patch (one frame per token)
    width: int = 64
    depth: int = 2

    def __post_init__(self):
        for key in ("channels", "text_dim", "patch_size", "width", "depth", "text_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")

    @property
    def patch(self) -> tuple[int, int, int]:
        return (1, self.patch_size, self.patch_size)

    @property
    def latent_channels(self) -> int:
        return self.channels

    @property
    def text_width(self) -> int:
        return self.text_dim

    def cost_model(self) -> CostModel:
        w, features = self.width, self.channels * self.patch_volume
        per_token = 2 * (2 * w * features + self.depth * 8 * w * w)
        return CostModel(a=0.0, b=3.0 * per_token, c=3.0 * 2 * (self.text_dim * w + 2 * self.depth * 3 * w * w))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.modulation = nn.Linear(width, 3 * width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.modulation(F.silu(cond)).chunk(3, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        return x + gate * self.down(F.gelu(self.up(h)))


class MLPDiT(TorchModel):
    recompute_modes = ("full",)

    def __init__(self, cfg: MLPDiTConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        features = cfg.channels * cfg.patch_volume
        self.patch_in = nn.Linear(features, w)
        self.time_in = nn.Linear(w, w)
        self.text_in = nn.Linear(cfg.text_dim, w)
        self.blocks = nn.ModuleList([Block(w) for _ in range(cfg.depth)])
        self.norm_out = nn.LayerNorm(w)
        self.proj_out = nn.Linear(w, features)
        self.recompute = False

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def set_recompute(self, mode: str) -> None:
        self.recompute = mode == "full"

    def forward(self, batch: PackedBatch, cp=None) -> torch.Tensor:
        if cp is not None:
            raise ValueError("mlp_dit does not implement context parallelism")
        x = self.patch_in(batch.patches)
        prompt = self.text_in(batch.text).mean(dim=1)  # [B, w]
        cond = (self.time_in(timestep_embedding(batch.timesteps, self.cfg.width)) + prompt)[batch.sample_index]
        for block in self.blocks:
            x = checkpoint(block, x, cond, use_reentrant=False) if self.recompute and self.training else block(x, cond)
        return self.proj_out(self.norm_out(x))


def make_task(recipe):
    from loongforge.diffusion.task import FlowMatchingTask

    return FlowMatchingTask(recipe)


MLP_DIT_SPEC = ModelSpec(name="mlp_dit", config_class=MLPDiTConfig, build=MLPDiT, engine="torch", task=make_task)
