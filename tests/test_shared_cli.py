"""The four ``lf-*`` CLIs are one framework: the same shared overrides mean the same thing in each,
every run writes the same loop metrics and checkpoints, and a run whose loss or gradient norm turns
non-finite stops naming the step, with its last good checkpoint kept."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loongforge.core.checkpoint import Checkpoint
from loongforge.diffusion.cli import main as lf_diffusion
from loongforge.embodied.cli import main as lf_embodied
from loongforge.llm.cli import main as lf_llm
from loongforge.vlm.cli import main as lf_vlm

pytestmark = pytest.mark.slow

SHARED = ["train.steps=3", "train.global_batch_size=4", "train.lr=1e-2", "train.min_lr_ratio=0.1", "train.warmup_steps=0",
          "log.interval=1", "checkpoint.interval=2", "log.progress=false"]
# the one schedule: cosine from lr at step 1 to lr * min_lr_ratio at step 4 (never reached)
LRS = [1e-2, 1e-3 + 9e-3 * 0.75, 1e-3 + 9e-3 * 0.25]
# what only one modality needs to run small on CPU (none of them renames a shared key)
CLIS = {"lf-llm": (lf_llm, []), "lf-vlm": (lf_vlm, []), "lf-diffusion": (lf_diffusion, ["data.synthetic_clips=12"]),
        "lf-embodied": (lf_embodied, [])}
LOOP_KEYS = {"step", "time", "loss", "grad_norm", "lr", "step_time_s", "samples_per_s", "consumed_samples"}
FAMILIES = {"lf-llm": "llama", "lf-vlm": "vlm", "lf-diffusion": "wan", "lf-embodied": "pi05"}


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(cli: str, run_dir, *extra: str) -> int:
    main, own = CLIS[cli]
    return main(["train", *SHARED, *own, f"log.run_dir={run_dir}", *extra])


@pytest.mark.parametrize("cli", list(CLIS))
def test_shared_overrides_mean_the_same_in_every_cli(cli, tmp_path):
    """The shared overrides train each CLI's default model 3 steps at lr 1e-2 with checkpoints at
    steps 2 and 3; the same run at lr 0 sees the same batches and noise, so the trained run's
    step-3 loss below the untrained one's is the loss falling on the same data."""
    assert train(cli, tmp_path / "run") == 0
    assert train(cli, tmp_path / "frozen", "train.lr=0", "train.min_lr_ratio=0") == 0
    got, frozen = records(tmp_path / "run"), records(tmp_path / "frozen")
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        assert LOOP_KEYS <= set(r), LOOP_KEYS - set(r)
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["samples_per_s"] > 0
    assert [r["lr"] for r in got] == pytest.approx(LRS, rel=1e-9)
    assert [r["consumed_samples"] for r in got] == [4, 8, 12]
    assert got[0]["loss"] == frozen[0]["loss"]  # the same initial weights, batch and noise
    assert got[2]["loss"] < frozen[2]["loss"]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000003" and (checkpoints / "step_00000002").is_dir()
    manifest = Checkpoint(checkpoints).manifest
    assert manifest["family"] == FAMILIES[cli] and manifest["consumed_samples"] == 12
    assert manifest["config"]["train"]["global_batch_size"] == 4 and manifest["config"]["checkpoint"]["interval"] == 2
    assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.parametrize("cli", list(CLIS))
def test_lr_alone_trains_each_clis_default_config(cli, tmp_path):
    """``train.lr=1e-4`` and nothing else of the schedule trains every CLI's default config: the
    last step's LR follows it (``train.min_lr_ratio``), the run ends at the rate the ratio gives."""
    main, own = CLIS[cli]
    run = tmp_path / "run"
    assert main(["train", "train.lr=1e-4", "train.steps=2", "train.warmup_steps=0", "train.global_batch_size=2",
                 *own, "log.interval=1", "log.progress=false", "checkpoint.save=false", f"log.run_dir={run}"]) == 0
    got = records(run)
    assert [r["step"] for r in got] == [1, 2] and all(math.isfinite(r["loss"]) for r in got)
    ratio = 1 / 30 if cli == "lf-embodied" else 0.1
    assert got[0]["lr"] == pytest.approx(1e-4, rel=1e-9)
    assert got[1]["lr"] == pytest.approx(1e-4 * ratio + (1e-4 - 1e-4 * ratio) * 0.5, rel=1e-9)  # cosine halfway


@pytest.mark.parametrize("cli", list(CLIS))
def test_a_non_finite_run_stops_naming_the_step_and_keeps_the_last_good_checkpoint(cli, tmp_path, capsys):
    """lr 1e30: the first update makes the weights huge, a later step's loss or gradient norm is not
    finite; the run stops there with exit 1 and one error line, before that update, and the
    checkpoint of the step before is the latest and finite."""
    run = tmp_path / "run"
    capsys.readouterr()
    assert train(cli, run, "train.steps=6", "train.lr=1e30", "train.min_lr_ratio=0", "checkpoint.interval=1") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: step "), err
    bad_step = int(err[0].split()[2].rstrip(":"))
    assert ("loss is" in err[0] or "grad_norm is" in err[0]) and "not finite" in err[0]
    assert 2 <= bad_step <= 6
    logged = records(run)
    assert logged[-1]["step"] == bad_step
    assert not (math.isfinite(logged[-1]["loss"]) and math.isfinite(logged[-1]["grad_norm"]))
    latest = Checkpoint(run / "checkpoints")
    assert latest.step == bad_step - 1
    assert all(torch.isfinite(t).all() for t in latest.tensors().values() if t.is_floating_point())


@pytest.mark.parametrize(("cli", "override", "message"), [
    ("lf-llm", "parallel.data_parallel=fsdp", "parallel.data_parallel='fsdp': the megatron-core engine"),
    ("lf-vlm", "train.compile=true", "train.compile=true: the megatron-core engine"),
    ("lf-diffusion", "parallel.tp=2", "parallel.tp=2: the PyTorch-native engine"),
    ("lf-embodied", "parallel.cp=2", "parallel.cp=2: this model does not implement context parallelism"),
    ("lf-embodied", "train.use_distributed_optimizer=true", "megatron-core engine options"),
])
def test_a_key_the_engine_cannot_honour_fails_before_any_process_group(cli, override, message, tmp_path, capsys):
    import torch.distributed as dist

    capsys.readouterr()
    assert train(cli, tmp_path / "run", override) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()
