"""The model-family registry (``loongforge.models`` entry points).

A family registers one ``ModelSpec``: everything the trainer needs to build, train, convert and
size it. Modality packages declare their families in their ``pyproject.toml``::

    [project.entry-points."loongforge.models"]
    llama = "loongforge.llm.families.llama:LLAMA_SPEC"

Two families with one name raise; so does asking for one that is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "loongforge.models"


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    ``build(model_config, ctx, pre_process, post_process)`` returns this rank's module (a
    megatron-core module for megatron families). ``layer_spec(model_config)`` gives the
    megatron ``ModuleSpec`` of one layer. ``flavours`` maps names ("debug", "0.5b") to
    ready model configs. ``flops_per_token(model_config, seq_length)`` is the training FLOPs
    per token (forward + backward) used for MFU and the balancer's cost model.
    ``hf_adapter`` converts to and from the Hugging Face layout; ``data_pipeline`` builds the
    family's default dataset.
    """

    name: str
    config_class: type
    build: Callable[..., Any]
    flavours: dict[str, Any] = field(default_factory=dict)
    layer_spec: Callable[[Any], Any] | None = None
    flops_per_token: Callable[[Any, int], float] | None = None
    hf_adapter: Any = None
    data_pipeline: Callable[..., Any] | None = None

    def flavour(self, name: str):
        if name not in self.flavours:
            raise KeyError(f"model family {self.name!r} has no flavour {name!r}; available: {sorted(self.flavours)}")
        return self.flavours[name]


class ModelRegistryError(LookupError):
    pass


def collect(specs: list[tuple[str, ModelSpec]]) -> dict[str, ModelSpec]:
    """Index specs by name; a duplicate name is an error naming both sources."""
    found: dict[str, tuple[str, ModelSpec]] = {}
    for source, spec in specs:
        if not isinstance(spec, ModelSpec):
            raise ModelRegistryError(f"{source} is not a ModelSpec")
        if spec.name in found:
            raise ModelRegistryError(f"model family {spec.name!r} is registered twice: by {found[spec.name][0]} and by {source}")
        found[spec.name] = (source, spec)
    return {name: spec for name, (_, spec) in found.items()}


@cache
def installed_models() -> dict[str, ModelSpec]:
    return collect([(ep.value, ep.load()) for ep in entry_points(group=ENTRY_POINT_GROUP)])


def get_model_spec(name: str) -> ModelSpec:
    models = installed_models()
    if name not in models:
        raise ModelRegistryError(f"no model family {name!r} is installed; installed: {', '.join(sorted(models)) or 'none'}")
    return models[name]
