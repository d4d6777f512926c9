"""``train --save-FORMAT OUT`` (the shared CLI builder): at the end of training the final checkpoint
is written to OUT exactly as ``convert lf-to-FORMAT`` writes it, for every modality with an export
direction; a bad target fails before any process group."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from loongforge.diffusion.cli import main as lf_diffusion
from loongforge.embodied.cli import main as lf_embodied

FAST = ["train.steps=2", "train.global_batch_size=4", "log.progress=false"]
CLIS = {"lf-diffusion": (lf_diffusion, "diffusers", ["data.synthetic_clips=8"]),
        "lf-embodied": (lf_embodied, "lerobot", [])}


def tensors(path) -> dict:
    """The tensors of a safetensors file, or of every one under a directory (keyed by file too)."""
    if path.is_file():  # lf-to-lerobot writes one model.safetensors
        return load_file(path)
    out = {}
    for f in sorted(path.rglob("*.safetensors")):
        out |= {f"{f.relative_to(path)}:{k}": v for k, v in load_file(f).items()}
    return out


@pytest.mark.parametrize("cli", list(CLIS))
def test_save_export_writes_what_convert_writes(cli, tmp_path):
    main, fmt, own = CLIS[cli]
    run = tmp_path / "run"
    assert main(["train", *FAST, *own, f"log.run_dir={run}", f"--save-{fmt}", str(tmp_path / "saved")]) == 0
    assert main(["convert", f"lf-to-{fmt}", str(run / "checkpoints" / "step_00000002"), str(tmp_path / "converted"),
                 "--no-progress"]) == 0
    saved, converted = tensors(tmp_path / "saved"), tensors(tmp_path / "converted")
    assert saved and saved.keys() == converted.keys()
    assert all(saved[k].equal(converted[k]) for k in saved)


def test_bad_save_target_is_one_error_line_before_training(tmp_path, capsys):
    (tmp_path / "exists").mkdir()
    capsys.readouterr()
    assert lf_diffusion(["train", *FAST, f"log.run_dir={tmp_path / 'run'}", "--save-diffusers", str(tmp_path / "exists")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --save-diffusers") and "exists" in err[0]
    assert not (tmp_path / "run").exists()
    assert lf_embodied(["train", *FAST, "checkpoint.save=false", "--save-lerobot", str(tmp_path / "new")]) == 2
    assert "checkpoint.save=true" in capsys.readouterr().err
