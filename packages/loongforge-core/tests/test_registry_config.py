import re
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint

import pytest

from loongforge.core.config import ConfigError, load_config
from loongforge.core.models import ENTRY_POINT_GROUP, ModelRegistryError, ModelSpec, load_specs, collect, get_model_spec


def test_duplicate_family_name_raises():
    a = ModelSpec(name="fam", config_class=dict, build=lambda *a: None)
    b = ModelSpec(name="fam", config_class=dict, build=lambda *a: None)
    with pytest.raises(ModelRegistryError, match="registered twice: by pkg_a:SPEC and by pkg_b:SPEC"):
        collect([("pkg_a:SPEC", a), ("pkg_b:SPEC", b)])


def test_installed_llama_and_missing_family():
    assert get_model_spec("llama").flavours["debug"] == "llama_debug"
    with pytest.raises(ModelRegistryError, match="no model family 'nope' is installed; installed: .*llama.*wan"):
        get_model_spec("nope")


def test_one_family_loads_only_its_own_package():
    """Looking up llama imports neither the diffusion package nor diffusers (seconds per process)."""
    script = ("import sys; from loongforge.core.models import get_model_spec; get_model_spec('llama'); "
              "print(sorted(m for m in ('diffusers', 'loongforge.diffusion', 'loongforge.embodied') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_a_checkpoints_family_is_found_loading_that_family_alone():
    """The family of an HF checkpoint's ``architectures`` comes from ``loongforge.hf_architectures``:
    an LLM checkpoint imports neither the diffusion nor the embodied package (nor diffusers)."""
    script = ("import sys; from loongforge.core.hf_mapping import family_for_architectures; "
              "print(family_for_architectures(['MistralForCausalLM'])[0], "
              "family_for_architectures(['Qwen3VLForConditionalGeneration'])[0], "
              "sorted(m for m in ('diffusers', 'loongforge.diffusion', 'loongforge.embodied') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "mistral vlm []", proc.stdout + proc.stderr[-2000:]


def test_declared_architectures_are_the_adapters():
    """Each installed family's ``HFAdapter.architectures`` are declared under
    ``loongforge.hf_architectures`` pointing at that family, and nothing else is."""
    from importlib.metadata import entry_points

    from loongforge.core.hf_mapping import HFAdapter
    from loongforge.core.models import HF_ARCHITECTURE_GROUP, installed_models

    adapters = {arch: name for name, spec in installed_models().items() if isinstance(spec.hf_adapter, HFAdapter)
                for arch in spec.hf_adapter.architectures}
    declared = {ep.name: ep.load().name for ep in entry_points(group=HF_ARCHITECTURE_GROUP)}
    assert "LlamaForCausalLM" in declared and "Qwen2_5_VLForConditionalGeneration" in declared
    assert declared == adapters


def test_an_undeclared_architecture_is_found_among_all_families(monkeypatch):
    """A family that does not declare its architectures (an older plugin) is still found: every
    installed family is loaded then; an unknown one is refused naming the supported ones."""
    from loongforge.core import models
    from loongforge.core.hf_mapping import MappingError, family_for_architectures

    monkeypatch.setattr(models, "declared_for_architecture", lambda arch: [])
    name, adapter = family_for_architectures(["Qwen2ForCausalLM"])
    assert name == "qwen2" and adapter is get_model_spec("qwen2").hf_adapter
    with pytest.raises(MappingError, match=r"x/config.json: architectures \['GPT2LMHeadModel'\] are not supported .*LlamaForCausalLM"):
        family_for_architectures(["GPT2LMHeadModel"], source="x/config.json")


def test_an_architecture_declared_by_two_families_is_refused(monkeypatch):
    from loongforge.core import models
    from loongforge.core.hf_mapping import MappingError, family_for_architectures

    qwen2 = get_model_spec("qwen2")
    twin = ModelSpec(name="qwen2_fork", config_class=dict, build=lambda *a: None, hf_adapter=qwen2.hf_adapter)
    monkeypatch.setattr(models, "declared_for_architecture", lambda arch: [qwen2, get_model_spec("qwen3"), twin])
    with pytest.raises(MappingError, match="c.json: architecture 'Qwen2ForCausalLM' is declared by several installed "
                                           r"model families \(qwen2, qwen2_fork\)"):
        family_for_architectures(["Qwen2ForCausalLM"], source="c.json")
    # one family declared twice (two entry points of one spec) is that family
    monkeypatch.setattr(models, "declared_for_architecture", lambda arch: [qwen2, qwen2])
    assert family_for_architectures(["Qwen2ForCausalLM"])[0] == "qwen2"


def test_every_modality_registers_its_families_and_each_loads_alone():
    """Wan and both policies register like the LLM families, each naming its engine and task; a
    lookup of one imports only its own modality package."""
    engines = {name: get_model_spec(name).engine for name in ("llama", "vlm", "wan", "pi0", "pi05", "pi05_dit_head")}
    assert engines == {"llama": "megatron", "vlm": "megatron", "wan": "torch", "pi0": "torch", "pi05": "torch",
                       "pi05_dit_head": "torch"}
    others = {"pi05": ("loongforge.llm", "loongforge.vlm", "loongforge.diffusion", "diffusers", "megatron"),
              "wan": ("loongforge.llm", "loongforge.vlm", "loongforge.embodied", "lerobot")}
    for name, modules in others.items():
        script = (f"import sys; from loongforge.core.models import get_model_spec; get_model_spec({name!r}); "
                  f"print(sorted(m for m in {modules!r} if m in sys.modules))")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "[]", (name, proc.stdout + proc.stderr[-2000:])


def test_components_register_by_name_and_role():
    from loongforge.core.models import ComponentSpec, get_component, installed_components

    assert set(installed_components("vision_encoder")) >= {"qwen2_5_vit", "siglip_vit"}
    assert set(installed_components("projector")) >= {"patch_merge_mlp", "mlp"}
    assert get_component("siglip_vit", "vision_encoder").config_class().family == "siglip_vit"
    with pytest.raises(ModelRegistryError, match="component 'mlp' is a projector, not a vision_encoder"):
        get_component("mlp", "vision_encoder")
    with pytest.raises(ModelRegistryError, match="no component 'clip_vit' is installed; installed: .*siglip_vit"):
        get_component("clip_vit")
    a = ComponentSpec(name="vit", role="vision_encoder", config_class=dict, build=lambda *a: None)
    with pytest.raises(ModelRegistryError, match="component 'vit' is registered twice"):
        collect([("pkg_a:VIT", a), ("pkg_b:VIT", a)], ComponentSpec, "component")


def test_entry_point_must_be_named_after_its_family():
    ep = EntryPoint(name="llama3", value="loongforge.llm.families.llama:LLAMA_SPEC", group=ENTRY_POINT_GROUP)
    with pytest.raises(ModelRegistryError, match="entry point 'llama3' .* registers model family 'llama'; the entry point must be named after it"):
        load_specs([ep])


@dataclass
class Part:
    kind: str = "a"
    size: int = 1


@dataclass
class Top:
    part: Part = field(default_factory=Part)
    steps: int = 3

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")


def test_compose_group_and_overrides(tmp_path):
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "big.yaml").write_text("kind: big\nsize: 9\n")
    (tmp_path / "main.yaml").write_text("defaults:\n  - part: big\n  - _self_\nsteps: 5\n")
    cfg = load_config(Top, "main", ["part.size=4"], [tmp_path])
    assert cfg == Top(part=Part(kind="big", size=4), steps=5)


def test_fixed_section_keeps_the_given_value(tmp_path):
    """A fixed section is the schema instance's: the YAML's group and keys for it are dropped (even
    keys its class would not know), and overriding it is an error with the given reason."""
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "big.yaml").write_text("kind: big\nsize: 9\nunknown_here: 1\n")
    (tmp_path / "main.yaml").write_text("defaults:\n  - part: big\n  - _self_\nsteps: 5\n")
    given = Top(part=Part(kind="given", size=2))
    cfg = load_config(given, "main", ["steps=6"], [tmp_path], fixed={"part": "the part comes from elsewhere"})
    assert cfg == Top(part=Part(kind="given", size=2), steps=6)
    for override in ("part.size=4", "part=big", "+part.kind=x"):
        with pytest.raises(ConfigError, match=rf"override '{re.escape(override)}': the part comes from elsewhere"):
            load_config(given, "main", [override], [tmp_path], fixed={"part": "the part comes from elsewhere"})


def test_errors_name_key_and_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("stepz: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown key 'stepz' \(did you mean 'steps'\?\)"):
        load_config(Top, str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="steps=0: must be >= 1"):
        load_config(Top, None, ["steps=0"])
    with pytest.raises(ConfigError, match="no config named 'missing'"):
        load_config(Top, "missing", [], [tmp_path])
