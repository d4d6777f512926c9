"""``lf-embodied`` end to end: train with no arguments (synthetic dataset written on first use),
convert to LeRobot's layout and back, eval."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from loongforge.core.checkpoint import Checkpoint
from loongforge.core.cli import normalise_overrides
from loongforge.core.hf_mapping import MappingError
from loongforge.core.hf_mapping.convert import lf_to_hf
from loongforge.embodied.cli import main
from loongforge.embodied.config import load_train_config


def test_policy_flag_selects_the_policy():
    assert load_train_config("train", normalise_overrides(["--policy", "groot"])).policy.family == "groot"


@pytest.mark.slow
def test_train_with_no_arguments_then_export_convert_eval(tmp_path, capsys):
    env = {**os.environ, "LOONGFORGE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "LOONGFORGE_ACCELERATOR": "cpu"}
    exe = shutil.which("lf-embodied")
    assert exe, "the lf-embodied entry point is not installed"
    proc = subprocess.run([exe, "train"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "cache" / "embodied-synthetic-v1" / "meta" / "info.json").is_file()
    run_dir = tmp_path / "runs" / "embodied"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(10, 101, 10))
    losses = [r["loss"] for r in records]  # each the mean over 10 steps
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    assert (run_dir / "tensorboard").is_dir() and "samples_per_s" in records[0]

    ours = Checkpoint(run_dir / "checkpoints").tensors("model.")
    ours = {k[len("model."):]: v for k, v in ours.items()}
    lerobot_file = tmp_path / "lerobot" / "model.safetensors"
    assert main(["convert", "lf-to-lerobot", str(run_dir), str(lerobot_file)]) == 0
    lerobot = load_file(str(lerobot_file))
    assert all(k.startswith("model.paligemma_with_expert.") or k.startswith("model.") for k in lerobot)
    torch.testing.assert_close(lerobot["model.action_out_proj.weight"], ours["action_out_proj.weight"])
    back = tmp_path / "back.safetensors"
    assert main(["convert", "lerobot-to-lf", str(lerobot_file), str(back)]) == 0
    converted = load_file(str(back))
    assert set(converted) == set(ours) and all(torch.equal(converted[k], ours[k]) for k in ours)
    assert main(["convert", "lerobot-to-lf", str(lerobot_file), str(back)]) == 2  # the output exists
    truncated = tmp_path / "truncated.safetensors"  # a file that does not fit the table: one error line
    save_file({k: v for k, v in lerobot.items() if "action_out_proj" not in k}, str(truncated))
    capsys.readouterr()
    assert main(["convert", "lerobot-to-lf", str(truncated), str(tmp_path / "never.safetensors")]) == 2
    assert "action_out_proj.bias" in capsys.readouterr().err
    # the whole-checkpoint converter of megatron families refuses a torch-engine checkpoint by name
    with pytest.raises(MappingError, match="'pi05' is trained by the torch engine"):
        lf_to_hf(run_dir / "checkpoints", tmp_path / "hf", progress=False)

    capsys.readouterr()
    dataset_root = tmp_path / "cache" / "embodied-synthetic-v1"
    assert main(["eval", "--checkpoint", str(run_dir), f"data.root={dataset_root}", "eval.max_batches=2"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["step"] == 100 and metrics["samples"] == 16 and metrics["episodes"] == 1
    assert metrics["action_mse"] > 0 and metrics["action_mse_normalized"] > 0
