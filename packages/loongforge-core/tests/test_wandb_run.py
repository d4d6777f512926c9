"""The pieces of ``log.wandb=true`` (``loongforge.core.wandb_run``): the run id kept for
resumption, the arguments handed to ``wandb.init``, the config checks, the records the metrics
logger hands over, and W&B refusing to start. The run through a CLI, offline, is in
tests/test_wandb_logging.py."""

from __future__ import annotations

import sys

import pytest

from loongforge.core.config import ConfigError
from loongforge.core.errors import UserError
from loongforge.core.metrics import MetricsLogger, read_metrics
from loongforge.core.training.schema import LogConfig
from loongforge.core.wandb_run import (
    INSTALL, RUN_ID_FILE, init_arguments, require_wandb, start_wandb_run, wandb_run_id,
)


def test_the_run_id_is_kept_for_a_resumed_run_and_new_for_a_fresh_one(tmp_path):
    ids = iter(["first", "second"])
    run_dir = tmp_path / "run"
    assert wandb_run_id(run_dir, resuming=False, new_id=lambda: next(ids)) == "first"
    assert (run_dir / RUN_ID_FILE).read_text().strip() == "first"
    assert wandb_run_id(run_dir, resuming=True, new_id=lambda: next(ids)) == "first"
    assert wandb_run_id(run_dir, resuming=False, new_id=lambda: next(ids)) == "second"  # a fresh start
    assert (run_dir / RUN_ID_FILE).read_text().strip() == "second"
    other = tmp_path / "resumed-without-wandb-before"
    assert wandb_run_id(other, resuming=True, new_id=lambda: "third") == "third"


def test_init_arguments_default_to_the_run_dir_and_leave_the_mode_to_wandb(tmp_path):
    config = {"train": {"steps": 2}}
    args = init_arguments(LogConfig(wandb=True), tmp_path / "my-run", config, "abc", environ={})
    assert args == dict(project="loongforge", entity=None, name="my-run", id="abc", resume="allow", config=config,
                        mode=None, dir=str(tmp_path / "my-run"))
    log = LogConfig(wandb=True, wandb_project="p", wandb_entity="team", wandb_name="n", wandb_mode="offline")
    args = init_arguments(log, tmp_path / "my-run", config, "abc", environ={"WANDB_DIR": "/elsewhere"})
    assert (args["project"], args["entity"], args["name"], args["mode"], args["dir"]) == (
        "p", "team", "n", "offline", "/elsewhere")


def test_log_config_checks_the_wandb_keys():
    with pytest.raises(ValueError, match=r"log.wandb_mode='cloud': one of online, offline, disabled"):
        LogConfig(wandb_mode="cloud")
    with pytest.raises(ValueError, match="log.wandb_project"):
        LogConfig(wandb_project="")


def test_require_wandb_names_the_extra_only_when_wandb_is_asked_for_and_missing(monkeypatch):
    require_wandb(LogConfig(wandb=True))  # installed in the workspace
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ModuleNotFoundError
    require_wandb(LogConfig(wandb=False))
    with pytest.raises(ConfigError, match=r"log.wandb=true needs the wandb package") as info:
        require_wandb(LogConfig(wandb=True))
    assert INSTALL in str(info.value) and isinstance(info.value, UserError)


class _Recorded:
    """What a ``WandbRun`` is handed: ``(step, metrics)`` pairs and how it is finished."""

    def __init__(self):
        self.logged, self.finished = [], []

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def finish(self, failed=False):
        self.finished.append(failed)


def test_the_metrics_logger_hands_each_record_to_the_wandb_run_and_finishes_it_once(tmp_path):
    import torch

    run = _Recorded()
    with MetricsLogger(tmp_path, tensorboard=False, wandb=run) as logger:
        logger.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3})
        logger.log(2, {"loss": float("nan"), "lr": 1e-3})
    assert [step for step, _ in run.logged] == [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert run.logged[0][1] == {"loss": 2.5, "lr": 1e-3}  # plain floats, no wall-clock "time"
    assert run.finished == [False]
    logger.close()
    assert run.finished == [False]  # once

    failed = _Recorded()
    with pytest.raises(RuntimeError), MetricsLogger(tmp_path / "failed", tensorboard=False, wandb=failed):
        raise RuntimeError("the step failed")
    assert failed.finished == [True]
    other_rank = _Recorded()
    MetricsLogger(tmp_path / "rank1", enabled=False, wandb=other_rank).log(1, {"loss": 1.0})
    assert other_rank.logged == []


def test_wandb_refusing_to_start_is_a_user_error_saying_how_to_go_on(tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(UserError, match=r"W&B could not start the run \(api_key not configured") as info:
        start_wandb_run(LogConfig(wandb=True), tmp_path / "run", {}, resuming=False)
    assert "wandb login" in str(info.value) and "log.wandb_mode=offline" in str(info.value)
