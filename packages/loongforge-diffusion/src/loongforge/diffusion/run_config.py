"""The run config of ``lf-diffusion``: its YAML (``configs/``) and ``key=value`` overrides, with
the architecture of ``model.pretrained`` (a diffusers directory or hub id) where one is given."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.config import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"


def load_recipe(config: str | None, overrides: list[str]):
    """Compose and validate a diffusion config. With ``model.pretrained=DIR`` the architecture keys
    come from DIR's config.json (over the YAML's); one also given on the command line must agree
    with it."""
    from loongforge.core.config import load_config, read_section
    from loongforge.diffusion.model.family import DEFAULT_FAMILY
    from loongforge.diffusion.schema import RENAMED_KEYS, DiffusionRecipe, recipe_schema

    from loongforge.core.hub import is_hub_id, resolve_local

    overrides = list(overrides)
    model = read_section(DiffusionRecipe, "model", config, overrides, [CONFIG_DIR], renamed=RENAMED_KEYS)
    family = model.get("family") or DEFAULT_FAMILY
    schema = recipe_schema(family)
    if model.get("pretrained"):
        pretrained = str(model["pretrained"])
        if is_hub_id(pretrained):  # owner/name: its snapshot in the hub cache
            pretrained = str(resolve_local(pretrained, key="model.pretrained"))
            overrides.append(f"model.pretrained={pretrained}")
        overrides += pretrained_overrides(family, pretrained, model, overrides)
    return load_config(schema, config, overrides, config_dirs=[CONFIG_DIR], renamed=RENAMED_KEYS)


# model.condition values a pretrained model's pipeline suggests but a command-line override may
# change: Wan 2.2 TI2V 5B's transformer trains with (ti2v) or without (none) a given first frame
TRAINING_MODES = ("none", "ti2v")


def pretrained_overrides(family: str, pretrained: str, model: dict, overrides: list[str]) -> list[str]:
    """The architecture of ``model.pretrained`` as overrides; an explicit ``model.KEY=V`` that
    differs from it is an error naming both."""
    import json

    from loongforge.diffusion.model.family import diffusers_adapter

    try:
        arch, source = diffusers_adapter(family).pretrained_architecture(pretrained)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    explicit = {o.split("=", 1)[0].strip().lstrip("+~").removeprefix("model.") for o in overrides
                if o.split("=", 1)[0].strip().lstrip("+~").startswith("model.")}
    if "condition" in explicit and arch.get("condition") in TRAINING_MODES:
        del arch["condition"]  # TI2V or not is how its transformer is trained, not its weights
    for key in sorted(explicit & set(arch)):
        given = list(model[key]) if isinstance(model.get(key), (list, tuple)) else model.get(key)
        if given != arch[key]:
            raise ConfigError(f"model.{key}={given!r} but {source} has {key}={arch[key]!r}; model.pretrained "
                              f"sets the architecture (drop the override)")
    return [f"model.{key}={json.dumps(value)}" for key, value in arch.items()]
