"""``mlp_policy``: a small flow-matching policy. Each camera is embedded by a strided convolution
and mean-pooled, the instruction tokens are mean-pooled, and an MLP of residual blocks maps
(cameras, instruction, state, noisy action chunk, time) to the velocity of the chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loongforge.core.models import ModelSpec
from loongforge.core.training.torch_model import TorchModel
from loongforge.embodied.config import PolicyConfig
from loongforge.embodied.policies.flow_matching import (
    euler_integrate,
    interpolate,
    sinusoidal_embedding,
    velocity_target,
)
from loongforge.embodied.task import PolicyTask


@dataclass
class MLPPolicyConfig(PolicyConfig):
    family: str = "mlp_policy"
    discrete_state: bool = False
    width: int = 64
    depth: int = 2


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPPolicy(TorchModel):
    family = "mlp_policy"
    recompute_modes = ("full",)
    fsdp_forward_methods = ("sample_actions",)

    def __init__(self, cfg: MLPPolicyConfig):
        super().__init__()
        self.cfg = cfg
        w, v = cfg.width, cfg.vision
        self.camera = nn.Conv2d(3, w, kernel_size=v.patch_size, stride=v.patch_size)
        self.tokens = nn.Embedding(cfg.vocab_size, w)
        self.inputs = nn.Linear(w * (cfg.num_cameras + 2) + cfg.max_state_dim, w)
        self.actions = nn.Linear(cfg.max_action_dim, w)
        self.blocks = nn.ModuleList([Block(w) for _ in range(cfg.depth)])
        self.out = nn.Linear(w, cfg.max_action_dim)
        self.recompute = False

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def set_recompute(self, mode: str) -> None:
        self.recompute = mode == "full"

    def context(self, batch: dict[str, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
        """``[B, width]``: cameras, instruction, state and time."""
        b, n = batch["images"].shape[:2]
        cams = self.camera(batch["images"].flatten(0, 1).to(self.camera.weight.dtype)).mean((2, 3)).reshape(b, n, -1)
        cams = cams * batch["image_mask"][..., None]
        mask = batch["token_mask"][..., None].float()
        words = (self.tokens(batch["tokens"]) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        time = sinusoidal_embedding(t, self.cfg.width, self.cfg.min_period, self.cfg.max_period)
        parts = [cams.flatten(1), words, batch["state"].to(words.dtype), time.to(words.dtype)]
        return self.inputs(torch.cat(parts, dim=-1))

    def velocity(self, context: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
        h = self.actions(x_t.to(context.dtype)) + context[:, None]
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.recompute and self.training else block(h)
        return self.out(h).float()

    def forward(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Per-element flow-matching loss ``[B, chunk, max_action_dim]``."""
        actions = batch["actions"].float()
        v = self.velocity(self.context(batch, t), interpolate(actions, noise, t))
        return (velocity_target(actions, noise) - v) ** 2

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, num_steps: int | None = None):
        return euler_integrate(lambda x_t, t: self.velocity(self.context(batch, t), x_t), noise.float(),
                               num_steps or self.cfg.num_inference_steps)


MLP_POLICY_SPEC = ModelSpec(name="mlp_policy", config_class=MLPPolicyConfig, build=MLPPolicy, engine="torch",
                            task=PolicyTask)
