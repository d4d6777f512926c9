"""The model-family registry (``loongforge.models`` entry points).

A family registers one ``ModelSpec`` (like torchtitan's ``TrainSpec``): everything the loop needs
to build, parallelise, feed, score, convert and size it. Every modality's families register the
same way (the LLM families, the VLM, Wan, the robot policies), and every ``lf-* train`` finds its
task through the spec of the family its config names. Modality packages declare their families in
their ``pyproject.toml``::

    [project.entry-points."loongforge.models"]
    llama = "loongforge.llm.families.llama:LLAMA_SPEC"

The entry point's name is the family's name. Asking for one family loads only the entry points
of that name, so training an LLM does not import the diffusion package's dependencies. Two
families with one name raise; so do an entry point whose spec has another name and asking for a
family that is not installed.

A family that reads Hugging Face checkpoints also names the ``architectures`` of their
``config.json`` (its ``HFAdapter.architectures``) under ``loongforge.hf_architectures``, each
entry point pointing at the family's spec, so that finding the family of a checkpoint loads that
family alone::

    [project.entry-points."loongforge.hf_architectures"]
    LlamaForCausalLM = "loongforge.llm.families.llama:LLAMA_SPEC"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from loongforge.core.errors import UserError

ENTRY_POINT_GROUP = "loongforge.models"
HF_ARCHITECTURE_GROUP = "loongforge.hf_architectures"


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    ``config_class`` is the dataclass of its model config (YAML keys are checked against it).
    ``build(model_config, ...)`` returns the module: for the megatron-core engine
    ``build(model_config, ctx, transformer_config, pre_process, post_process)``, this rank's chunk;
    for the PyTorch-native engine ``build(model_config)``, the whole model (which may describe its
    repeated blocks and parts for sharding: ``loongforge.core.training.torch_engine``). ``engine``
    names the engine of the loop that trains it (``megatron`` or ``torch``): the parallelise
    function is that engine's (TP/PP/EP from the layer specs; DDP/FSDP2/HSDP over the model's
    repeated blocks). ``task(run_config)`` makes the task the loop runs (the family's data pipeline
    and loss: ``loongforge.core.training.task``). ``layer_spec(model_config)`` gives the megatron
    ``ModuleSpec`` of one layer. ``flavours`` maps names ("debug", "0.5b") to ready model
    configs. ``hf_adapter`` converts to and from the family's outside layout (Hugging Face,
    diffusers, LeRobot) through ``loongforge.core.hf_mapping``. What the loop reads from a run
    (its FLOPs per token, its data) the task says (``loongforge.core.training.task.TrainTask``).
    """

    name: str
    config_class: type
    build: Callable[..., Any]
    engine: str = "megatron"
    task: Callable[[Any], Any] | None = None
    flavours: dict[str, Any] = field(default_factory=dict)
    layer_spec: Callable[[Any], Any] | None = None
    hf_adapter: Any = None

    def __post_init__(self):
        if self.engine not in ("megatron", "torch"):
            raise ValueError(f"model family {self.name!r}: engine {self.engine!r} is not one of megatron, torch")

    def make_task(self, run_config):
        """The task the loop runs for ``run_config`` (a family without one cannot be trained)."""
        if self.task is None:
            raise ModelRegistryError(f"model family {self.name!r} registers no training task")
        return self.task(run_config)

    def flavour(self, name: str):
        if name not in self.flavours:
            raise KeyError(f"model family {self.name!r} has no flavour {name!r}; available: {sorted(self.flavours)}")
        return self.flavours[name]


class ModelRegistryError(UserError, LookupError):
    pass


def collect(specs: list[tuple[str, Any]], spec_type: type[Any] = ModelSpec, what: str = "model family") -> dict:
    """Index specs by name; a duplicate name is an error naming both sources."""
    found: dict[str, tuple[str, Any]] = {}
    for source, spec in specs:
        if not isinstance(spec, spec_type):
            raise ModelRegistryError(f"{source} is not a {spec_type.__name__}")
        if spec.name in found:
            raise ModelRegistryError(f"{what} {spec.name!r} is registered twice: by {found[spec.name][0]} and by {source}")
        found[spec.name] = (source, spec)
    return {name: spec for name, (_, spec) in found.items()}


def load_specs(entries, spec_type: type[Any] = ModelSpec, what: str = "model family") -> dict:
    """Load the specs of these entry points, each checked to be named after its entry point."""
    specs = []
    for ep in entries:
        spec = ep.load()
        if isinstance(spec, spec_type) and spec.name != ep.name:
            raise ModelRegistryError(f"entry point {ep.name!r} ({ep.value}) registers {what} {spec.name!r}; "
                                     f"the entry point must be named after it")
        specs.append((ep.value, spec))
    return collect(specs, spec_type, what)


def _lookup(group: str, name: str, spec_type: type, what: str):
    found = load_specs(entry_points(group=group, name=name), spec_type, what)
    if name not in found:
        installed = sorted({ep.name for ep in entry_points(group=group)})
        raise ModelRegistryError(f"no {what} {name!r} is installed; installed: {', '.join(installed) or 'none'}")
    return found[name]


@cache
def installed_models() -> dict[str, ModelSpec]:
    """Every installed family (imports every modality package that registers one)."""
    return load_specs(entry_points(group=ENTRY_POINT_GROUP))


@cache
def get_model_spec(name: str) -> ModelSpec:
    """The family ``name``, loading only the entry points of that name."""
    return _lookup(ENTRY_POINT_GROUP, name, ModelSpec, "model family")


def declared_for_architecture(architecture: str) -> list[ModelSpec]:
    """The specs of the families that declare ``architecture`` (a ``config.json`` ``architectures``
    entry) under ``loongforge.hf_architectures``, loading those entry points alone."""
    specs = []
    for ep in entry_points(group=HF_ARCHITECTURE_GROUP, name=architecture):
        spec = ep.load()
        if not isinstance(spec, ModelSpec):
            raise ModelRegistryError(f"{ep.value} (entry point {architecture!r} of {HF_ARCHITECTURE_GROUP}) "
                                     f"is not a ModelSpec")
        specs.append(spec)
    return specs


# -- components ---------------------------------------------------------------------------------
COMPONENT_GROUP = "loongforge.components"


@dataclass(frozen=True)
class ComponentSpec:
    """A part that models compose, registered by name under ``loongforge.components`` like a
    family (a VLM's vision encoders and projectors). ``role`` says what slot it fills
    (``vision_encoder``, ``projector``); ``config_class`` validates its config group (the YAML's
    ``family`` key names the component); ``build(config, ...)`` makes the module, with the
    arguments its role defines."""

    name: str
    role: str
    config_class: type
    build: Callable[..., Any]


@cache
def get_component(name: str, role: str | None = None) -> ComponentSpec:
    """The component ``name`` (checked to fill ``role``), loading only entry points of that name."""
    spec = _lookup(COMPONENT_GROUP, name, ComponentSpec, "component")
    if role is not None and spec.role != role:
        raise ModelRegistryError(f"component {name!r} is a {spec.role}, not a {role}")
    return spec


def installed_components(role: str | None = None) -> dict[str, ComponentSpec]:
    """Every installed component (of ``role``)."""
    found = load_specs(entry_points(group=COMPONENT_GROUP), ComponentSpec, "component")
    return {n: s for n, s in found.items() if role is None or s.role == role}
