"""``log.wandb=true`` in offline mode (``WANDB_MODE=offline``): the run's W&B files are written under
RUN_DIR/wandb with the composed config and every logged step's metrics, a resumed run continues the
same W&B run, and without wandb installed the option is one error line before anything runs."""

from __future__ import annotations

import json
import sys

from loongforge.diffusion.cli import main as lf_diffusion

RUN = ["train.global_batch_size=4", "data.synthetic_clips=8", "log.progress=false", "log.wandb=true"]


def offline_runs(run_dir) -> list:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_offline_run_files_hold_the_config_and_every_metric(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    assert lf_diffusion(["train", *RUN, "train.steps=2", f"log.run_dir={run}"]) == 0
    run_id = (run / "wandb_run_id").read_text().strip()
    (first,) = offline_runs(run)
    assert first.name.endswith(run_id)
    (records,) = first.glob(f"run-{run_id}.wandb")
    data = records.read_bytes()
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    for row in logged:  # each metric's value, as W&B stores it (JSON), is in the run's records
        for key in ("loss", "grad_norm", "lr", "samples_per_s"):
            assert json.dumps(row[key]).encode() in data, (row["step"], key)
    assert b"global_batch_size" in data and b"synthetic_clips" in data  # the composed config
    # resumed: the same W&B run id, a new offline segment
    assert lf_diffusion(["train", *RUN, "train.steps=3", f"log.run_dir={run}"]) == 0
    assert (run / "wandb_run_id").read_text().strip() == run_id
    runs = offline_runs(run)
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)


def test_without_wandb_the_option_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: its import is blocked
    capsys.readouterr()
    assert lf_diffusion(["train", *RUN, f"log.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "log.wandb=true" in err[0] and 'pip install "loongforge-core[wandb]"' in err[0], err
    assert not (tmp_path / "run").exists()
