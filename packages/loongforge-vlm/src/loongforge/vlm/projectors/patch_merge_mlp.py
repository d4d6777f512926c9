"""Qwen2.5-VL's and Qwen3-VL's patch merger as a VLM component (``patch_merge_mlp``): a norm of
each patch (``merged_norm``: of the merged patches, as Qwen3-VL's DeepStack mergers), the merged
patches, Linear (to the merged width by default), GELU, Linear."""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.core.models import ComponentSpec
from loongforge.vlm.model_config import ProjectorConfig
from loongforge.vlm.projectors.base import Projector

NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}


@dataclass
class PatchMergeMLPConfig(ProjectorConfig):
    family: str = "patch_merge_mlp"
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    merged_norm: bool = False  # the norm over the merge² patches of a token together

    def __post_init__(self):
        super().__post_init__()
        if self.norm not in NORMS:
            raise ValueError(f"projector.norm={self.norm!r}: one of {', '.join(NORMS)}")

    def patch_norm(self) -> str:
        return NORMS[self.norm]

    def norm_after_merge(self) -> bool:
        return self.merged_norm

    def default_ffn(self, merged: int, foundation_hidden: int) -> int:
        return merged


PATCH_MERGE_MLP = ComponentSpec(name="patch_merge_mlp", role="projector", config_class=PatchMergeMLPConfig,
                                build=Projector)
