"""``log.wandb=true``: a Weights & Biases run beside ``metrics.jsonl``.

Rank 0 opens it when training starts, with the whole composed config, logs every metric record at
its step, and finishes it when training ends (exit code 1 when the run stopped on an error). The
W&B run id is kept in ``RUN_DIR/wandb_run_id``, so a resumed run continues the same W&B run.
``log.wandb_mode`` (online, offline, disabled) is handed to ``wandb.init``; unset, wandb's own
default applies (``WANDB_MODE``, else online). W&B's files go under ``RUN_DIR/wandb``.
"""

from __future__ import annotations

import uuid
from pathlib import Path

ID_FILE = "wandb_run_id"


class WandbRun:
    def __init__(self, run_dir: Path, log_cfg, config: dict | None):
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=log_cfg.wandb_project, entity=log_cfg.wandb_entity,
                               name=log_cfg.wandb_name or run_dir.resolve().name, id=run_id, resume="allow",
                               config=config or {}, dir=str(run_dir), mode=log_cfg.wandb_mode)
        self.id = run_id

    def log(self, step: int, metrics: dict) -> None:
        self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def finish(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)
