"""``lf-embodied convert``: a trained policy's weights <-> LeRobot's layouts.

Every policy family whose ``ModelSpec.hf_adapter`` is a ``LeRobotAdapter`` converts (Pi0, Pi0.5,
SmolVLA, GR00T N1.7's action head...): ``lf-to-lerobot`` writes a checkpoint's policy as LeRobot's
``model.safetensors`` (a LoRA run's adapters merged into the weights); ``lerobot-to-lf`` rewrites
such a file in LoongForge names (the family read off the file's tensors, each family's adapter
saying which names are its own), a file ``model.pretrained`` reads (or read LeRobot's file
directly with ``model.pretrained_format=lerobot``). ``lora-to-peft`` (the shared direction of
``loongforge.core.lora``) writes a LoRA run's adapters alone, named as ``lora_layouts`` says.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loongforge.core.config import to_dict
from loongforge.core.errors import DataError, OutputExistsError
from loongforge.core.lora import AdapterLayout, merge_lora, one_to_one_names
from loongforge.embodied.convert.lerobot_layout import (
    from_lerobot,
    lerobot_adapter,
    lerobot_families,
    lerobot_family,
    to_lerobot,
)
from loongforge.embodied.config import saved_model_section
from loongforge.embodied.restore import restore_policy


def _new_file(out: str | Path) -> Path:
    out = Path(out)
    if out.exists():
        raise OutputExistsError(f"{out} exists; the conversion writes a new file")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


LEROBOT_WEIGHTS, LEROBOT_CONFIG = "model.safetensors", "config.json"  # a saved LeRobot policy's files


def is_lerobot_directory(path: str | Path) -> bool:
    """``OUT`` names a LeRobot policy directory (``config.json`` + ``model.safetensors``), not a file."""
    return Path(path).suffix != ".safetensors"


def export_lerobot(path: str | Path, out: str | Path, dtype=None) -> tuple[Path, str]:
    """The policy of checkpoint ``path`` as LeRobot's ``model.safetensors`` at ``out`` (floating-point
    tensors cast to ``dtype`` when given), and a note on what was written. An ``out`` without the
    ``.safetensors`` suffix is a directory laid out as LeRobot saves a policy: ``model.safetensors``
    and, when LeRobot can build the policy's config, ``config.json`` (the family adapter's
    ``config_to_hf``; a tiny debug size has none, and the note says why)."""
    from loongforge.core.hf_mapping import MappingError

    from loongforge.core.config import ConfigError

    policy, cfg, ckpt = restore_policy(path)
    adapter = lerobot_adapter(cfg.model.family)
    if adapter is None:
        raise ConfigError(f"lf-to-lerobot: {path} is a model.family={cfg.model.family} checkpoint; only "
                          f"{', '.join(lerobot_families())} have a LeRobot layout (the checkpoint itself is "
                          f"what `checkpoint.load` and `lf-embodied eval` read)")
    merge_lora(policy)  # a LoRA run: W + (alpha / rank) B A, an ordinary LeRobot policy
    state = {k: v.contiguous() if dtype is None or not v.is_floating_point() else v.to(dtype).contiguous()
             for k, v in policy.state_dict().items()}
    state = to_lerobot(adapter, state, cfg.model)
    config, note = None, ""
    if is_lerobot_directory(out):
        try:
            config = adapter.config_to_hf(cfg.model)
        except MappingError as exc:
            note = f" (no {LEROBOT_CONFIG}: {exc})"
    meta = {"format": "lerobot", "family": cfg.model.family, "step": str(ckpt.step),
            "policy_config": json.dumps(to_dict(cfg.model)),
            "dataset": json.dumps(ckpt.manifest.get("dataset", {}))}
    if is_lerobot_directory(out):
        out = Path(out)
        if out.exists():
            raise OutputExistsError(f"{out} exists; the conversion writes a new directory")
        out.mkdir(parents=True)
        if config is not None:
            (out / LEROBOT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(out / LEROBOT_WEIGHTS), metadata=meta)
        return out, note
    out = _new_file(out)
    save_file(state, str(out), metadata=meta)
    return out, note


def import_lerobot(src: str | Path, out: str | Path) -> Path:
    """A LeRobot policy's ``model.safetensors`` rewritten in the LoongForge names of its family; ``src``
    may be a saved LeRobot policy's directory, whose ``config.json`` ``type`` then says the family."""
    src = Path(src)
    lerobot_type = None
    if src.is_dir():
        try:
            if (src / LEROBOT_CONFIG).is_file():
                lerobot_type = json.loads((src / LEROBOT_CONFIG).read_text()).get("type")
        except (OSError, ValueError, AttributeError) as exc:
            raise DataError(f"{src / LEROBOT_CONFIG}: not a LeRobot policy config ({exc})") from exc
        src = src / LEROBOT_WEIGHTS
    if not src.is_file():
        raise DataError(f"{src}: no such file (a LeRobot policy model.safetensors)")
    try:
        theirs = load_file(str(src))
    except (SafetensorError, OSError) as exc:  # not a safetensors file, or a truncated one
        raise DataError(f"{src}: not a safetensors file ({exc}); lerobot-to-lf reads a LeRobot policy's "
                        f"model.safetensors") from exc
    family, adapter = lerobot_family(theirs, source=str(src), lerobot_type=lerobot_type)
    state = from_lerobot(adapter, theirs, source=f"{src} (LeRobot {family})")
    out = _new_file(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out), metadata={"format": "loongforge", "family": family})
    return out


def lora_layouts(manifest: dict, names: list[str]) -> list[AdapterLayout]:
    """``convert lora-to-peft``: the adapters of a family with a LeRobot layout in LeRobot's names, as
    ``PeftModel.from_pretrained`` of LeRobot's policy loads them (e.g. ``base_model.model.model.paligemma_with_expert...``
    for ``PI05Policy``: LeRobot's own PEFT route, ``policy.use_peft``); other families have no LeRobot layout and keep
    LoongForge's names (``base_model.model.<name>``: a ``PeftModel`` of the LoongForge policy)."""
    from loongforge.embodied.config import PolicyConfig

    family = saved_model_section(manifest.get("config") or {}).get("family", PolicyConfig.family)
    adapter = lerobot_adapter(family)
    if adapter is None:
        return [AdapterLayout(prefix="", rename=lambda weights: {w: w for w in weights},
                              library=f"LoongForge {family}", key_prefix="base_model.model.")]
    base = [n for n in names if not n.endswith((".lora_A.weight", ".lora_B.weight"))]
    renames = one_to_one_names(adapter.mapping.bind(adapter.layout_from_state(base, "lf")))
    return [AdapterLayout(prefix="", rename=lambda weights: {w: renames[w] for w in weights if w in renames},
                          library=f"LeRobot {adapter.policy_class}", key_prefix="base_model.model." + adapter.policy_prefix)]
