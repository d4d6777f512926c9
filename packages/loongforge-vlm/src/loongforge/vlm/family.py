"""The ``vlm`` model family: an encoder + projector + foundation composition
(``loongforge.models`` entry point), with the Qwen2.5-VL, Qwen3-VL, Qwen3.5 and InternVL Hugging Face layouts."""

from __future__ import annotations

from loongforge.core.models import ModelSpec
from loongforge.vlm.hf import hf_adapter
from loongforge.vlm.model import VLMModelConfig, build_vlm


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
