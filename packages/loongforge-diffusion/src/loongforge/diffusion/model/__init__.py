"""The Wan 2.x video DiT in diffusers' ``WanTransformer3DModel`` parameter layout, running on packed
(variable-length, mixed-resolution) token sequences with optional Ulysses context parallelism."""

from loongforge.diffusion.model.config import EXPERT_NAMES, WanConfig
from loongforge.diffusion.model.dit import WanDiT
from loongforge.diffusion.model.experts import WanExperts

__all__ = ["EXPERT_NAMES", "WanConfig", "WanDiT", "WanExperts"]
