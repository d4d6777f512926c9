"""Kill-and-resume replays the uninterrupted run exactly (same losses bit for bit); resume checks."""

from __future__ import annotations

import json
import time

import pytest

from cli_runner import Job, run_cli
from embodied_helpers import tiny_overrides, train
from loongforge.core.checkpoint import Checkpoint, CheckpointReadError, latest_checkpoint
from loongforge.core.config import ConfigError
from loongforge.embodied.config import load_train_config


def find_resume_checkpoint(run_dir):
    return latest_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None

STEPS, SAVE_EVERY = 40, 4


def cli_args(dataset, run_dir) -> list[str]:
    return ["lf-embodied", "train", *tiny_overrides(dataset, run_dir, "log.tensorboard=false", "model=groot",
                                                     f"train.steps={STEPS}", f"checkpoint.interval={SAVE_EVERY}",
                                                     "log.interval=1", "train.warmup_steps=2")]


def step_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.mark.slow
def test_kill_and_resume_is_exact(tiny_dataset, tmp_path):
    """SIGKILL a run once its first checkpoint is committed; rerunning the same command resumes
    from the latest checkpoint and its losses are the uninterrupted run's, bit for bit (past the
    warm-up, so the LR schedule, the data position and the flow-matching noise all count)."""
    straight = tmp_path / "straight"
    proc = run_cli(cli_args(tiny_dataset, straight))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = step_losses(straight)
    assert sorted(want) == list(range(1, STEPS + 1)) and len(set(want.values())) == STEPS

    killed = tmp_path / "killed"
    killed.mkdir()
    job = Job(cli_args(tiny_dataset, killed), log_dir=killed)
    deadline = time.monotonic() + 300
    while find_resume_checkpoint(killed) is None:
        if job.poll()[0] is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail("the run ended or stalled before its first checkpoint:\n" + (killed / "rank0.log").read_text()[-3000:])
        time.sleep(0.01)
    assert job.kill() == [-9]
    resumed_from = Checkpoint(find_resume_checkpoint(killed)).step
    assert SAVE_EVERY <= resumed_from < STEPS
    (killed / "metrics.jsonl").rename(killed / "metrics-killed.jsonl")

    proc = run_cli(cli_args(tiny_dataset, killed))  # the same command again
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = step_losses(killed)
    assert sorted(got) == list(range(resumed_from + 1, STEPS + 1))
    assert got == {step: want[step] for step in got}  # exact equality
    manifest = json.loads((find_resume_checkpoint(killed) / "manifest.json").read_text())
    assert manifest["step"] == STEPS and manifest["family"] == "groot"
    assert manifest["consumed_samples"] == STEPS * 4 and any(k.startswith("optim.") for k in manifest["tensors"])


def run(dataset, run_dir, *extra):
    return train(load_train_config("train", tiny_overrides(dataset, run_dir, "log.tensorboard=false", "model=groot", *extra)))


def test_a_finished_run_trains_no_more(tiny_dataset, tmp_path):
    first = run(tiny_dataset, tmp_path / "d", "train.steps=2")
    again = run(tiny_dataset, tmp_path / "d", "train.steps=2")
    assert len(first.results) == 2 and again.start_step == 2 and again.results == []


def test_resume_refuses_a_different_policy(tiny_dataset, tmp_path):
    run(tiny_dataset, tmp_path / "c", "train.steps=1")
    with pytest.raises(CheckpointReadError, match="model.chunk_size"):
        run(tiny_dataset, tmp_path / "c", "train.steps=2", "model.chunk_size=3")


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.dit.widht"):
        load_train_config("train", ["model=groot", "model.dit.widht=3"])
    with pytest.raises(ConfigError, match="parallel.data_parallel='zero3'"):
        load_train_config("train", ["parallel.data_parallel=zero3"])
