"""One DiT (Wan 2.1, Wan 2.2 TI2V) or Wan 2.2's two experts, named as in diffusers' WanPipeline:
``transformer`` denoises timesteps ``t >= boundary_ratio * num_train_timesteps`` (high noise),
``transformer_2`` the rest (low noise)."""

from __future__ import annotations

import torch.nn as nn

from loongforge.core.training.torch_model import TorchModel
from loongforge.diffusion.model.config import WanConfig
from loongforge.diffusion.model.dit import WanDiT


class WanExperts(TorchModel):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.config = cfg
        self.names = cfg.part_names()
        for name in self.names:
            self.add_module(name, WanDiT(cfg))

    def parts(self) -> dict[str, nn.Module]:
        """The experts, wrapped and trained separately by the engine (a step trains one)."""
        return {name: getattr(self, name) for name in self.names}

    def expert(self, name: str) -> nn.Module:
        if name not in self.names:
            raise KeyError(f"no expert {name!r}; this model has {self.names}")
        return getattr(self, name)
