"""InternVL's projector as a VLM component (``internvl_pixel_shuffle_mlp``): pixel shuffle with
ratio 0.5 (the 2x2 patches of one LLM token concatenated, 4x the encoder's width: the encoder
keeps them consecutive, so this is the shared merge), a LayerNorm over the merged patches,
Linear to the foundation's width, GELU, Linear."""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.core.models import ComponentSpec
from loongforge.vlm.model_config import ProjectorConfig
from loongforge.vlm.projectors.base import Projector


@dataclass
class PixelShuffleMLPConfig(ProjectorConfig):
    family: str = "internvl_pixel_shuffle_mlp"
    norm_epsilon: float = 1e-5  # transformers' InternVLMultiModalProjector: nn.LayerNorm's default

    def patch_norm(self) -> str:
        return "LayerNorm"

    def norm_after_merge(self) -> bool:
        return True


INTERNVL_PIXEL_SHUFFLE_MLP = ComponentSpec(name="internvl_pixel_shuffle_mlp", role="projector",
                                           config_class=PixelShuffleMLPConfig, build=Projector)
