"""The model-family registry (``loongforge.models`` entry points).

A family registers one ``ModelSpec``: everything the trainer needs to build, train, convert and
size it. Modality packages declare their families in their ``pyproject.toml``::

    [project.entry-points."loongforge.models"]
    llama = "loongforge.llm.families.llama:LLAMA_SPEC"

The entry point's name is the family's name. Asking for one family loads only the entry points
of that name, so training an LLM does not import the diffusion package's dependencies. Two
families with one name raise; so do an entry point whose spec has another name and asking for a
family that is not installed.
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


def load_specs(entries) -> dict[str, ModelSpec]:
    """Load the specs of these entry points, each checked to name its own family."""
    specs = []
    for ep in entries:
        spec = ep.load()
        if isinstance(spec, ModelSpec) and spec.name != ep.name:
            raise ModelRegistryError(f"entry point {ep.name!r} ({ep.value}) registers model family {spec.name!r}; "
                                     f"the entry point must be named after its family")
        specs.append((ep.value, spec))
    return collect(specs)


@cache
def installed_models() -> dict[str, ModelSpec]:
    """Every installed family (imports every modality package that registers one)."""
    return load_specs(entry_points(group=ENTRY_POINT_GROUP))


@cache
def get_model_spec(name: str) -> ModelSpec:
    """The family ``name``, loading only the entry points of that name."""
    models = load_specs(entry_points(group=ENTRY_POINT_GROUP, name=name))
    if name not in models:
        installed = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
        raise ModelRegistryError(f"no model family {name!r} is installed; installed: {', '.join(installed) or 'none'}")
    return models[name]
