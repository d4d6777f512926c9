"""``lf-embodied convert``: a trained policy's weights <-> LeRobot's Pi0 / Pi0.5 layouts.

``lf-to-lerobot`` writes a checkpoint's pi0 or pi05 policy as LeRobot's ``PI0Policy`` /
``PI05Policy`` ``model.safetensors`` (a LoRA run's adapters merged into the weights);
``lerobot-to-lf`` rewrites such a file in LoongForge names (the family read off the file's
tensors: Pi0 has ``state_proj`` and the action-time MLP), a file ``model.pretrained`` reads (or
read LeRobot's file directly with ``model.pretrained_format=lerobot``). ``lora-to-peft`` (the shared direction of
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
    LEROBOT_POLICY_PREFIX,
    LeRobotLayout,
    from_lerobot,
    lerobot_adapter,
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


LEROBOT_FAMILIES = ("pi0", "pi05")  # the families with a LeRobot layout (their hf_adapter)
PI0_ONLY_HEADS = ("state_proj.", "action_time_mlp_")  # Pi0's heads; Pi0.5 has time_mlp_* instead


def lerobot_family(names) -> str:
    """``pi0`` or ``pi05``: which LeRobot policy a state dict's names are of."""
    bare = (n.removeprefix(LEROBOT_POLICY_PREFIX) for n in names)
    return "pi0" if any(n.startswith(PI0_ONLY_HEADS) for n in bare) else "pi05"


def export_lerobot(path: str | Path, out: str | Path, dtype=None) -> Path:
    """The Pi0 / Pi0.5 policy of checkpoint ``path`` as LeRobot's ``model.safetensors`` at ``out``
    (floating-point tensors cast to ``dtype`` when given)."""
    from loongforge.core.config import ConfigError

    policy, cfg, ckpt = restore_policy(path)
    adapter = lerobot_adapter(cfg.model.family)
    if adapter is None:
        raise ConfigError(f"lf-to-lerobot: {path} is a model.family={cfg.model.family} checkpoint; only "
                          f"{' and '.join(LEROBOT_FAMILIES)} have a LeRobot layout (the checkpoint itself is "
                          f"what `checkpoint.load` and `lf-embodied eval` read)")
    merge_lora(policy)  # a LoRA run: W + (alpha / rank) B A, an ordinary LeRobot policy
    state = {k: v.contiguous() if dtype is None or not v.is_floating_point() else v.to(dtype).contiguous()
             for k, v in policy.state_dict().items()}
    state = to_lerobot(adapter.mapping, state, cfg.model)
    meta = {"format": "lerobot", "family": cfg.model.family, "step": str(ckpt.step),
            "policy_config": json.dumps(to_dict(cfg.model)),
            "dataset": json.dumps(ckpt.manifest.get("dataset", {}))}
    out = _new_file(out)
    save_file(state, str(out), metadata=meta)
    return out


def import_lerobot(src: str | Path, out: str | Path) -> Path:
    """A LeRobot ``PI0Policy`` / ``PI05Policy`` ``model.safetensors`` rewritten in ``Pi0Policy`` /
    ``Pi05Policy`` names."""
    src = Path(src)
    if not src.is_file():
        raise DataError(f"{src}: no such file (a LeRobot pi0 or pi05 model.safetensors)")
    try:
        theirs = load_file(str(src))
    except (SafetensorError, OSError) as exc:  # not a safetensors file, or a truncated one
        raise DataError(f"{src}: not a safetensors file ({exc}); lerobot-to-lf reads a LeRobot pi0 or pi05 "
                        f"model.safetensors") from exc
    family = lerobot_family(theirs)
    state = from_lerobot(lerobot_adapter(family).mapping, theirs, source=f"{src} (LeRobot {family})")
    out = _new_file(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out), metadata={"format": "loongforge", "family": family})
    return out


def lora_layouts(manifest: dict, names: list[str]) -> list[AdapterLayout]:
    """``convert lora-to-peft``: pi0 / pi05 adapters in LeRobot's names, as ``PeftModel.from_pretrained``
    of LeRobot's ``PI0Policy`` / ``PI05Policy`` loads them (``base_model.model.model.paligemma_with_expert...``,
    LeRobot's own PEFT route, ``policy.use_peft``); other families have no LeRobot layout and keep
    LoongForge's names (``base_model.model.<name>``: a ``PeftModel`` of the LoongForge policy)."""
    family = saved_model_section(manifest.get("config") or {}).get("family", "pi05")
    adapter = lerobot_adapter(family)
    if adapter is None:
        return [AdapterLayout(prefix="", rename=lambda weights: {w: w for w in weights},
                              library=f"LoongForge {family}", key_prefix="base_model.model.")]
    mapping = adapter.mapping
    counts = mapping.counts_in([n for n in names if not n.endswith((".lora_A.weight", ".lora_B.weight"))], side="lf")
    bound = mapping.bind(LeRobotLayout(counts["layer"], counts["vision_layer"]))
    renames = one_to_one_names(bound)
    return [AdapterLayout(prefix="", rename=lambda weights: {w: renames[w] for w in weights if w in renames},
                          library=f"LeRobot {family.upper()}Policy", key_prefix="base_model.model.model.")]
