"""The task of an ``lf-llm`` run config's ``recipe`` (what the LLM families register as ``ModelSpec.task``)."""

from __future__ import annotations

from loongforge.llm.recipe import LLMConfig, LLMTask
from loongforge.llm.sft_recipe import SFTTask


def make_task(cfg: LLMConfig) -> LLMTask:
    """The task of ``cfg.recipe``: pre-training on indexed data, or SFT on conversations."""
    if cfg.recipe == "sft":
        return SFTTask(cfg)
    return LLMTask(cfg)
