"""The ``vlm`` model family: an encoder + projector + foundation composition
(``loongforge.models`` entry point), with the Qwen2.5-VL, Qwen3-VL and InternVL Hugging Face layouts."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.vlm.hf import hf_adapter
from loongforge.vlm.model import VisionLanguageModel, VLMModelConfig
from loongforge.vlm.parallel import build_vision_groups


def build_vlm(cfg: VLMModelConfig, ctx, transformer_config, pre_process: bool = True, post_process: bool = True, *,
              encoder_tp: int = 1, split_across_foundation_tp: bool = True, encoder_recompute: str = "none"):
    """This rank's VLM; the vision tower gets its own process groups (``build_vision_groups``)."""
    groups = build_vision_groups(ctx, encoder_tp, split_across_foundation_tp)
    return VisionLanguageModel(cfg, transformer_config, ctx.pgs, groups, encoder_recompute=encoder_recompute,
                               pre_process=pre_process, post_process=post_process)


def make_task(cfg):
    """The VLM SFT task of an ``lf-vlm`` config."""
    from loongforge.vlm.recipe import VLMTask

    return VLMTask(cfg)


VLM_SPEC = ModelSpec(
    name="vlm",
    config_class=VLMModelConfig,
    build=build_vlm,
    engine="megatron",
    task=make_task,
    hf_adapter=hf_adapter(),
)
