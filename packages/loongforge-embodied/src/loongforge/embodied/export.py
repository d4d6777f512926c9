"""Export a trained policy's weights to one safetensors file (LoongForge or LeRobot names), and
convert LeRobot Pi0.5 weights into LoongForge names for ``policy.pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from loongforge.embodied.convert.lerobot_pi05 import from_lerobot_pi05, to_lerobot_pi05
from loongforge.embodied.restore import restore_policy


def _checkpoint_path(path: str | Path) -> Path:
    path = Path(path)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def export_checkpoint(path: str | Path, out: str | Path, fmt: str = "loongforge") -> Path:
    policy, cfg, ckpt = restore_policy(_checkpoint_path(path))
    sd = {k: v.contiguous() for k, v in policy.state_dict().items()}
    if fmt == "lerobot":
        if policy.family != "pi05":
            raise ValueError(f"--format lerobot: only pi05 has a LeRobot layout mapping, this checkpoint is {policy.family!r}")
        sd = to_lerobot_pi05(sd)
    elif fmt != "loongforge":
        raise ValueError(f"export format {fmt!r}: one of loongforge, lerobot")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": fmt, "family": policy.family, "step": str(ckpt.step),
            "policy_config": json.dumps(ckpt.manifest["config"]["policy"]),
            "dataset": json.dumps(ckpt.manifest.get("dataset", {}))}
    save_file(sd, str(out), metadata=meta)
    return out


def convert_lerobot_file(src: str | Path, out: str | Path) -> Path:
    """A LeRobot ``PI05Policy`` ``model.safetensors`` rewritten in ``Pi05Policy`` names."""
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise FileNotFoundError(f"--from-lerobot {str(src)!r}: no such file")
    sd = from_lerobot_pi05(load_file(str(src)))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out), metadata={"format": "loongforge", "family": "pi05"})
    return out
