"""The task and model contract is declared, not probed: every task in the packages subclasses the
engine's base task class (``loongforge.core.training.task``), every torch-engine model is a
``TorchModel``, and core calls the declared hooks, never ``getattr``/``hasattr`` on a task or a model."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest

from loongforge.core.models import installed_models
from loongforge.core.training.task import MegatronTask, TorchTask, TrainTask
from loongforge.core.training.torch_model import TorchModel

ROOT = Path(__file__).resolve().parent.parent
CORE_TRAINING = ROOT / "packages" / "loongforge-core" / "src" / "loongforge" / "core" / "training"
BASES = {"megatron": MegatronTask, "torch": TorchTask}


def _task_classes() -> list[tuple[str, str]]:
    """``(module, class)`` of every class in the packages' sources that
    defines both ``steps`` and ``forward(self, model, ...)``: what the loop runs as a task."""
    found = []
    for path in (ROOT / "packages").glob("*/src/loongforge/**/*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
            fwd = methods.get("forward")
            if "steps" in methods and fwd is not None and [a.arg for a in fwd.args.args[:2]] == ["self", "model"]:
                base = next(p for p in path.parents if p.name == "src")
                found.append((".".join(path.relative_to(base).with_suffix("").parts), node.name))
    return found


def test_every_task_class_subclasses_its_engine_base():
    classes = _task_classes()
    names = {name for _, name in classes}
    assert {"LLMTask", "SFTTask", "VLMTask", "FlowMatchingTask", "PolicyTask"} <= names
    for module, name in classes:
        if module == "loongforge.core.training.task":  # the base classes themselves
            continue
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, (MegatronTask, TorchTask)), f"{module}.{name} is not a MegatronTask or TorchTask"
        assert not inspect.isabstract(cls), f"{module}.{name} leaves {sorted(cls.__abstractmethods__)} out"


@pytest.mark.parametrize("name", sorted(installed_models()))
def test_every_registered_family_declares_its_task_and_model(name):
    spec = installed_models()[name]
    if isinstance(spec.task, type):
        assert issubclass(spec.task, BASES[spec.engine])
    if spec.engine == "torch":  # the model the torch engine trains is a TorchModel
        built = spec.build if isinstance(spec.build, type) else typing.get_type_hints(spec.build)["return"]
        assert issubclass(built, TorchModel), f"{name}: builds {built.__name__}, not a TorchModel"


def test_the_plugin_example_policy_is_a_torch_model(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugin_example"))
    from lf_plugin_example.mlp_policy import MLP_POLICY_SPEC

    assert issubclass(MLP_POLICY_SPEC.build, TorchModel) and issubclass(MLP_POLICY_SPEC.task, TorchTask)


def _hooks(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")} - {"family", "engine"}


PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:self\.|trainer\.|engine\.)?(task|model|part|inner_model)\b")


def test_core_calls_declared_hooks_without_probing():
    probes = []
    for path in sorted(CORE_TRAINING.glob("*.py")) + [CORE_TRAINING.parent / "models.py"]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if PROBE.search(line):
                probes.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not probes, "core probes a task or model instead of calling a declared hook:\n" + "\n".join(probes)


def test_the_hooks_core_calls_are_declared():
    """Every ``task.<name>`` core's training modules read is a hook of a base task class, every
    ``part.<name>`` / ``model.parts()`` one of ``TorchModel``."""
    declared = _hooks(MegatronTask) | _hooks(TorchTask) | {"family", "engine"}
    used_task, used_model = set(), set()
    for path in CORE_TRAINING.glob("*.py"):
        text = path.read_text()
        used_task |= set(re.findall(r"\btask\.([a-z_]+)", text))
        used_model |= set(re.findall(r"\bpart\.([a-z_]+)\b", text)) | set(re.findall(r"\bmodel\.(parts)\(", text))
    assert used_task <= declared, f"core reads undeclared task attributes: {sorted(used_task - declared)}"
    assert {"parts", "repeated_blocks", "set_recompute", "compile_regions", "recompute_modes",
            "fsdp_forward_methods"} <= _hooks(TorchModel)
    assert used_model <= _hooks(TorchModel), f"core reads undeclared model attributes: {sorted(used_model - _hooks(TorchModel))}"
    assert issubclass(MegatronTask, TrainTask) and issubclass(TorchTask, TrainTask)
