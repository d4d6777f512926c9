"""Why a training run stops early (each printed by the CLIs as one ``error:`` line)."""

from __future__ import annotations

from pathlib import Path

from loongforge.core.errors import UserError


class EarlierRunError(UserError):
    """A fresh run (``checkpoint.resume=false``) into a checkpoint directory that holds an earlier
    run's checkpoints, without ``checkpoint.overwrite=true``: nothing was written."""


class NonFiniteError(RuntimeError):
    """The run stopped on a non-finite value: a step's loss or gradient norm (its update was not
    applied; ``streak`` such steps in a row, ``train.nonfinite_patience``), or the weights about to
    be checkpointed (``metric == "weights"``: the checkpoint was not written)."""

    def __init__(self, step: int, metric: str, value: float, last_checkpoint: Path | None, result=None,
                 streak: int = 1):
        self.step, self.metric, self.value, self.last_checkpoint = step, metric, value, last_checkpoint
        self.result = result  # the step's StepResult (logged before the run stops)
        kept = f"the last checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
        if metric == "weights":
            what = f"step {step}: the weights are not finite; its checkpoint was not saved"
        else:
            row = f" ({streak} steps in a row, train.nonfinite_patience)" if streak > 1 else ""
            what = f"step {step}: {metric} is {value} (not finite){row}; stopped before applying its update"
        super().__init__(f"{what}; {kept}")


class TrainingStopped(Exception):
    """The run stopped on a signal (``preemption``) after ``step``, its state saved in
    ``checkpoint`` (None: no checkpoint). The trainer has said so in one line; the CLI exits with
    ``exit_code`` (75 for SIGTERM / SIGUSR1: requeue the job; 130 for Ctrl-C)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, line: str):
        from loongforge.core.training.preemption import exit_code

        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = exit_code(signum)
        super().__init__(line)
