"""Run metrics: one JSON line per logged step in ``RUN_DIR/metrics.jsonl``, TensorBoard scalars,
Weights & Biases (``log.wandb``), and the tqdm progress bar long work shows.

A run that starts at step N (a resume, or 0 for a fresh start) first cuts ``metrics.jsonl`` back to
its whole records of steps up to N (``cut_back``; the file as it was is kept beside it), so that
every step appears once: a crash may leave records past the checkpoint resumed from, or half a
line."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm


class MetricsLogger:
    """Appends ``{"step": ..., "time": ..., **metrics}`` lines and TensorBoard scalars.

    Only the process with ``enabled=True`` (normally global rank 0) writes anything.
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True, wandb=None):
        """``wandb``: a ``WandbRun`` to log to as well (rank 0's), or None."""
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._writer = None
        self._file = None
        self._wandb = wandb if enabled else None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
            if tensorboard:
                self._writer = tensorboard_writer(self.run_dir / "tensorboard")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "item") else v) for k, v in metrics.items()}
        record = {"step": int(step), "time": time.time(), **clean}
        assert self._file is not None  # open while enabled
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        if self._writer is not None:
            for key, value in clean.items():
                if isinstance(value, float) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(step, clean)

    def close(self, failed: bool = False) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish(failed)
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(failed=exc_type is not None)
        return False


def tensorboard_writer(log_dir: Path):
    """A TensorBoard ``SummaryWriter`` for ``log_dir``; without the ``tensorboard`` package (the
    ``loongforge-core[tensorboard]`` extra) a one-line notice and ``None``: the metrics still go
    to ``metrics.jsonl``."""
    try:
        import tensorboard  # noqa: F401  (the backend of torch.utils.tensorboard)
    except ModuleNotFoundError as exc:
        if exc.name != "tensorboard":
            raise
        print("notice: log.tensorboard=true but the tensorboard package is not installed; no TensorBoard "
              "scalars for this run (metrics.jsonl has them all). Install it with: "
              "pip install 'loongforge-core[tensorboard]'", file=sys.stderr, flush=True)
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl``, in order. A missing file is a FileNotFoundError,
    a line that is not a JSON object with an integer ``step`` a ValueError, each naming the file
    (and line)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a run directory?)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{path}:{number}: not a metrics record ({exc})") from None
        records.append(record)
    return records


def cut_back(path: str | Path, step: int) -> Path | None:
    """Cut the JSONL file ``path`` (records with an integer ``step``, in order) back to its whole
    records up to ``step``: everything from the first record past ``step``, the first line that is
    not a record or a last line without its newline on is dropped. The file as it was is kept as
    ``<name>.bak-K`` (the first free K), which is returned; None when there was nothing to cut."""
    path = Path(path)
    if not path.is_file():
        return None
    data = path.read_bytes()
    keep = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not isinstance(record, dict) or not isinstance(record.get("step"), int) or record["step"] > step:
                break
        keep += len(line)
    if keep == len(data):
        return None
    backup = next(candidate for k in range(1, 1 << 20)
                  if not (candidate := path.with_name(f"{path.name}.bak-{k}")).exists())
    shutil.copy2(path, backup)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data[:keep])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # the old file stays whole until this moment (and in the backup after it)
    return backup


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0) -> tqdm:
    """A progress bar (disabled on non-main ranks)."""
    return tqdm(total=total, desc=desc, initial=initial, disable=not enabled, dynamic_ncols=True, leave=True)
