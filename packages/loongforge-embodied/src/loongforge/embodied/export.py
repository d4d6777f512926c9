"""``lf-embodied convert``: a trained policy's weights <-> LeRobot's Pi0.5 layout.

``lf-to-lerobot`` writes a checkpoint's policy as LeRobot's ``PI05Policy`` ``model.safetensors``;
``lerobot-to-lf`` rewrites such a file in LoongForge names, a file ``policy.pretrained`` reads (or
read LeRobot's file directly with ``policy.pretrained_format=lerobot``).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from loongforge.core.errors import DataError, OutputExistsError
from loongforge.embodied.convert.lerobot_pi05 import from_lerobot_pi05, to_lerobot_pi05
from loongforge.embodied.restore import restore_policy


def checkpoint_path(path: str | Path) -> Path:
    """A run directory's ``checkpoints``, or the checkpoint (root or step directory) itself."""
    path = Path(path)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def _new_file(out: str | Path) -> Path:
    out = Path(out)
    if out.exists():
        raise OutputExistsError(f"{out} exists; the conversion writes a new file")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def export_lerobot(path: str | Path, out: str | Path) -> Path:
    """The Pi0.5 policy of checkpoint ``path`` as LeRobot's ``model.safetensors`` at ``out``."""
    policy, cfg, ckpt = restore_policy(checkpoint_path(path))
    if cfg.policy.family != "pi05":
        raise ValueError(f"lf-to-lerobot: only pi05 has a LeRobot layout mapping, this checkpoint is {cfg.policy.family!r}")
    state = to_lerobot_pi05({k: v.contiguous() for k, v in policy.state_dict().items()}, cfg.policy)
    meta = {"format": "lerobot", "family": cfg.policy.family, "step": str(ckpt.step),
            "policy_config": json.dumps(ckpt.manifest["config"]["policy"]),
            "dataset": json.dumps(ckpt.manifest.get("dataset", {}))}
    out = _new_file(out)
    save_file(state, str(out), metadata=meta)
    return out


def import_lerobot(src: str | Path, out: str | Path) -> Path:
    """A LeRobot ``PI05Policy`` ``model.safetensors`` rewritten in ``Pi05Policy`` names."""
    src = Path(src)
    if not src.is_file():
        raise DataError(f"{src}: no such file (a LeRobot pi05 model.safetensors)")
    state = from_lerobot_pi05(load_file(str(src)))
    out = _new_file(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out), metadata={"format": "loongforge", "family": "pi05"})
    return out
