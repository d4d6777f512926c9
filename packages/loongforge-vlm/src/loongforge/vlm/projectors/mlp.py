"""LLaVA's ``mlp2x_gelu`` as a VLM component (``mlp``): the merged patches, Linear to the
foundation's width, GELU, Linear."""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.core.models import ComponentSpec
from loongforge.vlm.model_config import ProjectorConfig
from loongforge.vlm.projectors.base import Projector


@dataclass
class MLPProjectorConfig(ProjectorConfig):
    family: str = "mlp"


MLP = ComponentSpec(name="mlp", role="projector", config_class=MLPProjectorConfig, build=Projector)
