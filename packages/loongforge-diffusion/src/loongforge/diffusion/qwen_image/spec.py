"""The ``qwen_image`` model family for the core registry (``loongforge.models`` entry point)."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.models import ModelSpec
from loongforge.diffusion.qwen_image import convert
from loongforge.diffusion.qwen_image.config import QwenImageConfig
from loongforge.diffusion.qwen_image.transformer import QwenImageTransformer

MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "model"


def make_task(recipe):
    """Text-to-image flow matching on latent shards (one-frame latents), the shared packed task."""
    from loongforge.diffusion.task import FlowMatchingTask

    return FlowMatchingTask(recipe)


def load_flavour(name: str) -> QwenImageConfig:
    from loongforge.core.config import load_config

    return load_config(QwenImageConfig, str(MODEL_CONFIGS / f"{QWEN_IMAGE_SPEC.flavour(name)}.yaml"))


QWEN_IMAGE_SPEC = ModelSpec(
    name="qwen_image",
    config_class=QwenImageConfig,
    build=QwenImageTransformer,
    engine="torch",
    task=make_task,
    flavours={"debug": "qwen_image_tiny", "qwen-image": "qwen_image_20b"},
    hf_adapter=convert,
)
