"""``lf-embodied`` end to end: train with no arguments (synthetic dataset written on first use),
convert to LeRobot's layout and back, eval."""

from __future__ import annotations

import json
import math
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
    assert load_train_config("train", normalise_overrides(["--model", "groot"])).model.family == "groot"


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
    half = tmp_path / "lerobot-bf16" / "model.safetensors"  # --dtype casts the floating-point weights
    assert main(["convert", "lf-to-lerobot", str(run_dir), str(half), "--dtype", "bf16"]) == 0
    cast = load_file(str(half))
    assert sorted(cast) == sorted(lerobot)
    assert all(cast[k].dtype == (torch.bfloat16 if v.is_floating_point() else v.dtype) and torch.equal(
        cast[k], v.to(cast[k].dtype)) for k, v in lerobot.items())
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
    assert main(["eval", "--checkpoint", str(run_dir), f"data.path={dataset_root}", "eval.max_batches=2"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["step"] == 100 and metrics["samples"] == 16 and metrics["episodes"] == 1
    assert metrics["action_mse"] > 0 and metrics["action_mse_normalized"] > 0


@pytest.mark.slow
def test_pi0_trains_from_the_cli_then_converts_to_lerobot_and_back(tiny_dataset, tmp_path):
    """``--model pi0`` trains the debug Pi0 on CPU (finite losses; lower on fixed noise and times);
    ``lf-to-lerobot`` writes
    what LeRobot's PI0Pytorch loads strictly, and ``lerobot-to-lf`` gives the checkpoint back bitwise."""
    from torch.utils.data import default_collate

    from embodied_helpers import tiny_overrides
    from lerobot_reference import build_lerobot_pi0
    from loongforge.embodied.data.dataset import EmbodiedDataset
    from loongforge.embodied.policies import build_policy
    from loongforge.embodied.policies.flow_matching import draw_noise_and_time
    from loongforge.embodied.task import masked_flow_loss

    run = tmp_path / "run"
    args = tiny_overrides(tiny_dataset, run, "--model", "pi0", "train.steps=16", "log.interval=1", "log.tensorboard=false",
                          "checkpoint.interval=16", "train.warmup_steps=2", "train.lr=1e-2")
    assert main(["train", *args]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 16 and all(map(math.isfinite, losses))
    cfg = load_train_config("train", normalise_overrides(args))
    assert cfg.model.family == "pi0" and not cfg.model.discrete_state
    ours = {k[len("model."):]: v for k, v in Checkpoint(run / "checkpoints").tensors("model.").items()}
    # the per-step losses are noisy (random times); on every training frame with fixed noise and
    # times, the trained weights beat the run's initial ones (seeded by train.seed)
    data = EmbodiedDataset(cfg.data, cfg.model, str(tiny_dataset))
    batch = default_collate([data[i] for i in range(len(data))])
    noise, t = draw_noise_and_time(0, 0, (len(data), 4, 4), **cfg.model.time_kwargs())
    torch.manual_seed(cfg.train.seed)
    policy = build_policy(cfg.model).eval()
    with torch.no_grad():
        initial = masked_flow_loss(batch, policy(batch, noise, t))
        policy.load_state_dict(ours)
        trained = masked_flow_loss(batch, policy(batch, noise, t))
    assert trained[0] / trained[1] < 0.8 * initial[0] / initial[1], (initial, trained)

    lerobot_file = tmp_path / "lerobot" / "model.safetensors"
    assert main(["convert", "lf-to-lerobot", str(run), str(lerobot_file)]) == 0
    exported = load_file(str(lerobot_file))
    reference = build_lerobot_pi0(cfg.model)
    reference.load_state_dict({k[len("model."):]: v for k, v in exported.items()}, strict=True)
    assert torch.equal(exported["model.state_proj.weight"], ours["state_proj.weight"])
    back = tmp_path / "back.safetensors"
    assert main(["convert", "lerobot-to-lf", str(lerobot_file), str(back)]) == 0
    converted = load_file(str(back))
    assert set(converted) == set(ours) and all(torch.equal(converted[k], ours[k]) for k in ours)
    from safetensors import safe_open

    with safe_open(str(back), "pt") as f:
        assert f.metadata()["family"] == "pi0"
