"""The ``wan`` model family for the core registry (``loongforge.models`` entry point)."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.models import ModelSpec
from loongforge.diffusion.model import convert
from loongforge.diffusion.model.config import WanConfig
from loongforge.diffusion.model.experts import WanExperts

MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "model"


def build(model_config: WanConfig) -> WanExperts:
    """The family's module: one DiT, or Wan 2.2's two experts (separately wrapped parts)."""
    return WanExperts(model_config)


def make_task(recipe):
    """Flow matching on latent shards, the task of an ``lf-diffusion`` config."""
    from loongforge.diffusion.task import FlowMatchingTask

    return FlowMatchingTask(recipe)


def load_flavour(name: str) -> WanConfig:
    from loongforge.core.config import load_config

    return load_config(WanConfig, str(MODEL_CONFIGS / f"{WAN_SPEC.flavour(name)}.yaml"))


WAN_SPEC = ModelSpec(
    name="wan",
    config_class=WanConfig,
    build=build,
    engine="torch",
    task=make_task,
    flavours={"debug": "tiny", "debug-i2v": "tiny_i2v", "debug-ti2v": "tiny_ti2v",
              "wan2.1-t2v-1.3b": "wan2_1_t2v_1_3b", "wan2.1-i2v-14b": "wan2_1_i2v_14b",
              "wan2.2-t2v-a14b": "wan2_2_t2v_a14b", "wan2.2-ti2v-5b": "wan2_2_ti2v_5b"},
    hf_adapter=convert,
)
