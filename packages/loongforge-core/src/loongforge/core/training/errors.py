"""Why a training run stops early (each printed by the CLIs as one ``error:`` line)."""

from __future__ import annotations

from pathlib import Path


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was not finite; its update was not applied."""

    def __init__(self, step: int, metric: str, value: float, last_checkpoint: Path | None, result=None):
        self.step, self.metric, self.value, self.last_checkpoint = step, metric, value, last_checkpoint
        self.result = result  # the step's StepResult (logged before the run stops)
        kept = f"the last checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
        super().__init__(f"step {step}: {metric} is {value} (not finite); stopped before applying its update; {kept}")
