"""``log.wandb=true`` through a real ``lf-*`` CLI, W&B offline: the run's W&B file holds every
logged step's loss (the same as metrics.jsonl), the whole config, the run dir's name and a clean
exit; a resumed run continues the same W&B run; a run stopped by a non-finite loss finishes its
W&B run as failed; W&B's files go to RUN_DIR/wandb unless WANDB_DIR says otherwise; and without
the wandb package the run stops before it starts, naming the extra, while the config still loads."""

from __future__ import annotations

import json
import sys

import pytest
import wandb_records

from loongforge.diffusion.cli import main as lf_diffusion

pytestmark = pytest.mark.slow

TINY = ["data.synthetic_clips=8", "train.global_batch_size=2", "train.warmup_steps=0", "log.progress=false",
        "log.tensorboard=false", "log.wandb=true"]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its settings, cache and staging under tmp_path, WANDB_DIR unset."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    import wandb

    wandb.teardown()  # W&B reads its environment once per process: the next test starts afresh


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wandb_files(root, run_id: str) -> list:
    """The run files of W&B run ``run_id``, oldest first (one per process that logged to it)."""
    return sorted(root.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_an_offline_run_logs_every_step_and_a_resumed_run_continues_it(tmp_path, offline_wandb, monkeypatch):
    root = tmp_path / "wandb-root"
    root.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(root))
    run_dir = tmp_path / "my-run"
    assert lf_diffusion(["train", *TINY, "train.steps=2", f"log.run_dir={run_dir}"]) == 0
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    (first,) = _wandb_files(root, run_id)
    records = wandb_records.read_records(first)
    logged = _metrics(run_dir)
    history = wandb_records.history(records)
    assert [row["_step"] for row in history] == [r["step"] for r in logged] == [1, 2]
    for row, record in zip(history, logged):
        assert row["loss"] == pytest.approx(record["loss"], rel=1e-12)
        assert {"grad_norm", "lr", "step_time_s", "samples_per_s", "consumed_samples"} <= set(row)
    run = wandb_records.run_record(records)
    assert (run.run_id, run.project, run.display_name) == (run_id, "loongforge", "my-run")
    config = wandb_records.config(records)
    assert config["train"]["steps"] == 2 and config["log"]["wandb"] is True
    assert config["log"]["run_dir"] == str(run_dir) and "model" in config
    assert wandb_records.exit_code(records) == 0
    assert not (run_dir / "wandb").exists()  # WANDB_DIR wins over the run dir

    # the same command, two more steps: it resumes from step 2's checkpoint and the same W&B run
    assert lf_diffusion(["train", *TINY, "train.steps=4", f"log.run_dir={run_dir}"]) == 0
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    files = _wandb_files(root, run_id)
    assert len(files) == 2 and len(list(root.glob("wandb/offline-run-*"))) == 2
    resumed = wandb_records.read_records(files[1])
    assert [row["_step"] for row in wandb_records.history(resumed)] == [3, 4]
    assert [row["loss"] for row in wandb_records.history(resumed)] == pytest.approx(
        [r["loss"] for r in _metrics(run_dir)[2:]], rel=1e-12)
    assert wandb_records.run_record(resumed).run_id == run_id


def test_a_run_stopped_by_a_non_finite_loss_is_a_failed_wandb_run(tmp_path, offline_wandb, capsys):
    run_dir = tmp_path / "run"
    capsys.readouterr()
    assert lf_diffusion(["train", *TINY, "train.steps=6", "train.lr=1e30", "train.min_lr_ratio=0",
                         "checkpoint.save=false", f"log.run_dir={run_dir}"]) == 1
    assert "not finite" in capsys.readouterr().err
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    (path,) = _wandb_files(run_dir, run_id)  # no WANDB_DIR: under RUN_DIR/wandb
    records = wandb_records.read_records(path)
    history = wandb_records.history(records)
    assert [row["_step"] for row in history] == [r["step"] for r in _metrics(run_dir)]
    assert wandb_records.exit_code(records) == 1


def test_log_wandb_without_the_package_stops_before_any_process_group(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ModuleNotFoundError
    capsys.readouterr()
    assert lf_diffusion(["train", *TINY, "train.steps=2", f"log.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: log.wandb=true needs the wandb package"), err
    assert 'pip install "loongforge-core[wandb]"' in err[0]
    assert not dist.is_initialized() and not (tmp_path / "run").exists()
    # the config itself is fine: what reads it without training (info, convert, sample) still works
    assert lf_diffusion(["info", *TINY]) == 0
