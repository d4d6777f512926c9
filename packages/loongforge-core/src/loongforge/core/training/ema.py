"""Exponential moving average of the trained weights (kept for the parameters this rank holds:
whole tensors under DDP, local shards under FSDP2), in fp32. The PyTorch-native engine updates it
after every ``ema.update_interval`` steps and checkpoints it as ``ema.<parameter name>``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge.core.training.sharding import local


@dataclass
class EmaConfig:
    decay: float = 0.0  # 0: no EMA weights
    update_interval: int = 1  # steps between EMA updates (each update uses decay ** update_interval)

    def __post_init__(self):
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"ema.decay={self.decay}: must be in [0, 1)")
        if self.update_interval < 1:
            raise ValueError(f"ema.update_interval={self.update_interval}: must be >= 1")


class EMA:
    def __init__(self, named_params: dict[str, torch.nn.Parameter], decay: float):
        self.decay = decay
        self.params = named_params
        self.shadow = {k: local(p).detach().clone().float() for k, p in named_params.items()}

    @torch.no_grad()
    def update(self) -> None:
        names = list(self.params)
        current = [local(self.params[k]).detach().float() for k in names]
        torch._foreach_lerp_([self.shadow[k] for k in names], current, 1.0 - self.decay)

    @torch.no_grad()
    def copy_to(self, named_params: dict[str, torch.nn.Parameter]) -> None:
        for k, p in named_params.items():
            local(p).copy_(self.shadow[k].to(local(p).dtype))
