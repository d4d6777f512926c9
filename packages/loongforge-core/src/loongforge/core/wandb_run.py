"""Weights & Biases logging of a training run: ``log.wandb=true`` (the ``loongforge-core[wandb]`` extra).

Global rank 0 opens one W&B run when the loop starts, with the run's whole composed config; every
record the loop writes to ``metrics.jsonl`` goes to it too, at its step; the loop finishes it when
it ends, also when it stops on an error (with exit code 1 then, so W&B marks the run failed).

The run's W&B id is kept in ``RUN_DIR/wandb_run_id``: a run resumed from its checkpoint continues
the same W&B run (``resume="allow"``), a run that starts afresh starts a new one. W&B's local files
go to ``RUN_DIR/wandb/`` unless ``WANDB_DIR`` names another place. ``log.wandb_mode`` is handed to
``wandb.init`` (null leaves the choice to ``WANDB_MODE`` or W&B's default, online); the environment
is read, never written.

Without the wandb package a run asking for it stops before any process group is made
(``require_wandb``), naming the extra to install.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path

from loongforge.core.config import ConfigError
from loongforge.core.errors import UserError

RUN_ID_FILE = "wandb_run_id"
INSTALL = 'pip install "loongforge-core[wandb]"'


def wandb_installed() -> bool:
    """Whether ``import wandb`` can find the package (nothing is imported)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except ValueError:  # a module object without a spec already in sys.modules: importable
        return True


def require_wandb(log_cfg) -> None:
    """A ``ConfigError`` when ``log.wandb=true`` and the wandb package is not installed."""
    if log_cfg.wandb and not wandb_installed():
        raise ConfigError(f"log.wandb=true needs the wandb package, which is not installed; install it with: "
                          f"{INSTALL} (or set log.wandb=false)")


def new_run_id() -> str:
    """A fresh W&B run id: 12 lowercase hex digits."""
    return secrets.token_hex(6)


def wandb_run_id(run_dir: Path, resuming: bool, new_id: Callable[[], str] = new_run_id) -> str:
    """The W&B id of this run: the one ``RUN_DIR/wandb_run_id`` keeps when the run resumes from its
    checkpoint, else a new one, written there for the run's resumptions."""
    path = run_dir / RUN_ID_FILE
    if resuming and path.is_file():
        kept = path.read_text().strip()
        if kept:
            return kept
    fresh = new_id()
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(fresh + "\n")
    return fresh


def init_arguments(log_cfg, run_dir: Path, config: dict, run_id: str, environ: Mapping[str, str]) -> dict:
    """The keyword arguments of ``wandb.init`` for a run with ``log`` config ``log_cfg`` in ``run_dir``."""
    return dict(
        project=log_cfg.wandb_project,
        entity=log_cfg.wandb_entity,
        name=log_cfg.wandb_name or run_dir.resolve().name,
        id=run_id,
        resume="allow",
        config=config,
        mode=log_cfg.wandb_mode,  # None: WANDB_MODE or W&B's default
        # W&B reads WANDB_DIR once per process; handed over here, each run follows the environment it starts in
        dir=environ.get("WANDB_DIR") or str(run_dir),
    )


class WandbRun:
    """One open W&B run, what ``MetricsLogger`` hands its records to: ``log(step, metrics)``, then
    ``finish(failed)`` once (``failed``: exit code 1, a failed run in W&B)."""

    def __init__(self, run, run_id: str):
        self._run = run
        self.id = run_id

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        if self._run is not None:
            self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=int(step))

    def finish(self, failed: bool = False) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=1 if failed else 0)


def start_wandb_run(log_cfg, run_dir: Path, config: dict, resuming: bool) -> WandbRun:
    """Open the W&B run of this training run (see the module doc). W&B refusing to start it (not
    logged in, an unknown entity, ...) is a ``UserError`` saying how to go on."""
    import wandb

    run_id = wandb_run_id(run_dir, resuming)
    kwargs = init_arguments(log_cfg, run_dir, config, run_id, os.environ)
    try:
        run = wandb.init(**kwargs)
    except wandb.errors.Error as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"log.wandb=true: W&B could not start the run ({reason}); log in with `wandb login`, "
                        f"or set log.wandb_mode=offline (sync later with `wandb sync`) or log.wandb=false") from exc
    return WandbRun(run, run_id)
