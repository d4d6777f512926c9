"""The run config of ``lf-vlm`` (its config groups composed, each part validated as its family's
config class) and the task it trains. Importing this module is cheap: the config classes are
imported when a config is loaded."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # loongforge.vlm.recipe's, without its imports


def config_dirs() -> list[Path]:
    """The VLM's configs, and loongforge-llm's (the ``foundation`` group reuses its model configs)."""
    from loongforge.llm.api import CONFIG_DIR as LLM_CONFIG_DIR

    return [CONFIG_DIR, LLM_CONFIG_DIR]


def load_vlm_config(name: str | None, overrides: list[str]):
    """The composed config, its ``encoder`` and ``projector`` groups validated as their families'
    own config classes (registered components), the ``foundation`` as its LLM family's."""
    from loongforge.core.config import ConfigError, load_config, read_section
    from loongforge.core.models import ModelRegistryError, get_component, get_model_spec
    from loongforge.vlm.recipe import VLMConfig

    dirs, overrides = config_dirs(), list(overrides)
    parts = {}
    for section, role, default in (("encoder", "vision_encoder", "qwen2_5_vit"), ("projector", "projector", "patch_merge_mlp")):
        family = read_section(VLMConfig, section, name, overrides, dirs).get("family", default)
        try:
            parts[section] = get_component(family, role).config_class()
        except ModelRegistryError as exc:
            raise ConfigError(f"{section}.family={family!r}: {exc}") from exc
    family = read_section(VLMConfig, "foundation", name, overrides, dirs).get("family", "llama")
    try:
        parts["foundation"] = get_model_spec(family).config_class()
    except ModelRegistryError as exc:
        raise ConfigError(f"foundation.family={family!r}: {exc}") from exc
    from loongforge.core.hub import resolve_local

    cfg = load_config(VLMConfig(**parts), name, overrides, dirs)
    cfg.data.tokenizer = resolve_local(cfg.data.tokenizer, key="data.tokenizer")  # owner/name: its hub snapshot
    return cfg


def make_task(cfg):
    """The VLM task, through the ``vlm`` family's registered spec."""
    from loongforge.core.models import get_model_spec

    return get_model_spec("vlm").make_task(cfg)
