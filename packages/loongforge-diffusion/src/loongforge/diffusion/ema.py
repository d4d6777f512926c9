"""Exponential moving average of the trained weights (kept for the parameters this rank holds:
whole tensors under DDP, local shards under FSDP2)."""

from __future__ import annotations

import torch

from loongforge.diffusion.sharding import local


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
