"""``lf-X train --nproc-per-node N``: the job's processes started by the CLI itself
(``loongforge.core.launch``), with the error contract intact: one line, the right exit code."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from cli_runner import assert_one_error_line, run_cli
from loongforge.core.config import ConfigError
from loongforge.core.launch import check_not_launched, launch_local, signal_name, worker_argv

TESTS = Path(__file__).resolve().parent
CPU = {"LOONGFORGE_ACCELERATOR": "cpu"}


def test_workers_get_the_arguments_less_the_flag():
    assert worker_argv(["train", "--nproc-per-node", "2", "train.steps=3"]) == ["train", "train.steps=3"]
    assert worker_argv(["--debug", "train", "--nproc-per-node=4", "--config", "x"]) == ["--debug", "train", "--config", "x"]


def test_the_flag_under_another_launcher_is_refused():
    check_not_launched(2, 1)
    with pytest.raises(ConfigError, match="--nproc-per-node 2: this process is already one of a job of 4"):
        check_not_launched(2, 4)


def test_a_layout_the_processes_cannot_take_fails_before_any_worker(tmp_path):
    proc = run_cli(["lf-llm", "train", "--nproc-per-node", "2", "parallel.tp=3", f"log.run_dir={tmp_path}/run"],
                   env=CPU, timeout=300)
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, "parallel.tp=3", "world size 2")
    assert not (tmp_path / "run").exists()  # no worker started


@pytest.mark.slow
def test_two_workers_train_one_job(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(["lf-llm", "train", "--nproc-per-node", "2", "train.steps=2", "train.global_batch_size=4",
                    "log.interval=1", "log.progress=false", "checkpoint.save=false", f"log.run_dir={run}"],
                   env=CPU, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "cpu x2 (tp=1 pp=1 cp=1 ep=1 dp=2)" in proc.stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


@pytest.mark.slow
def test_a_worker_error_is_the_workers_one_line(tmp_path):
    """A mistake only the workers see (the data) is their one line and exit code, without the
    launcher's ChildFailedError report."""
    proc = run_cli(["lf-llm", "train", "--nproc-per-node", "2", f"data.prefixes=[{tmp_path}/missing]",
                    f"log.run_dir={tmp_path}/run"], env=CPU, timeout=300)
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, f"{tmp_path}/missing")
    assert "ChildFailedError" not in proc.stderr + proc.stdout


def test_a_killed_worker_is_named_with_its_signal(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    lines = []
    code = launch_local("launch_probe", [], 2, report=lines.append)
    assert code == 1
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 was stopped by SIGKILL"), lines


def test_signal_names():
    assert signal_name(-signal.SIGTERM) == "SIGTERM"
    assert signal_name(-200) == "signal 200"
