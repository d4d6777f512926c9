"""The training loop: one for every modality, over the engine the task names.

It owns the step accounting (steps, consumed samples, ``train.exit_interval``), the LR schedule
(``schedule.lr_at``), the check that every step's loss and gradient norm are finite (a non-finite
one's update is skipped, and ``train.nonfinite_patience`` of them in a row stop the run), metrics (progress bar, ``RUN_DIR/metrics.jsonl``, TensorBoard: loss, its mean since the last record, grad norm, LR,
step time, samples/s, tokens/s for token data, MFU where FLOPs are known, the task's own step
metrics), the evaluation hook (``eval.interval``), checkpoint cadence and exact resume through the
core format (``checkpointing``; a save is refused when the weights are not finite, so ``keep_last``
never prunes the last finite checkpoint), and ``RUN_DIR/config.yaml`` (the run's whole composed config). The
engine (``engine_choice.make_engine``) does the rest of a step.

A run starts by checking what its directories hold, before it writes anything: a run that does not
resume refuses a checkpoint directory with an earlier run's checkpoints unless told to start over
(``checkpoint.overwrite=true``, which removes them once the config is accepted); a resume checks the
checkpoint against the config (``resume_settings``: the schedule may change, the data position may
not). Only then is ``config.yaml`` written and ``metrics.jsonl`` cut back to the step the run starts
at (``metrics.cut_back``), so every step appears once in it.

While ``fit`` runs, SIGTERM, SIGUSR1 and Ctrl-C stop the run at the next step boundary, every rank
together, with a checkpoint of the step reached (``preemption``).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongforge.core.checkpoint.storage import RUN_CHECKPOINTS
from loongforge.core.errors import storage_error
from loongforge.core.metrics import MetricsLogger, cut_back, progress
from loongforge.core.training import checkpointing
from loongforge.core.training.engine import StepOutput
from loongforge.core.training.engine_choice import make_engine
from loongforge.core.training.errors import NonFiniteError, TrainingStopped
from loongforge.core.training.preemption import REQUEUE_EXIT_CODE, StopSignals, agreed_stop, describe, exit_code
from loongforge.core.training.schedule import lr_at
from loongforge.core.training.task import StepBatch


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    samples: int
    seconds: float
    tokens: int | None = None
    flops: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    compute_seconds: float = float("nan")

    @property
    def skipped(self) -> bool:
        """Its loss or grad norm was not finite: the update was not applied."""
        return not (math.isfinite(self.loss) and math.isfinite(self.grad_norm))


class Trainer:
    """Runs ``task`` with the run config ``cfg`` (its ``train``, ``parallel``, ``checkpoint``,
    ``log`` and, when present, ``eval`` and ``ema`` groups) in the process groups of ``ctx``.
    ``report(line)`` prints what the main process says about the run directory (default: ``print``)."""

    def __init__(self, task, ctx, cfg, config_record: dict | None = None, report: Callable[[str], None] | None = None):
        self.task, self.ctx, self.cfg = task, ctx, cfg
        self.report = report or (lambda line: print(line, flush=True))
        self.train, self.log_cfg, self.ckpt_cfg = cfg.train, cfg.log, cfg.checkpoint
        self.eval_cfg = getattr(cfg, "eval", None)
        self.config_record = config_record or {}
        self.run_dir = Path(self.log_cfg.run_dir)
        self.ckpt_dir = Path(self.ckpt_cfg.dir) if self.ckpt_cfg.dir else self.run_dir / RUN_CHECKPOINTS
        self.resuming = bool(self.ckpt_cfg.resume) and checkpointing.has_checkpoint(self.ckpt_dir)
        if self.resuming:  # what the task saved in the manifest, back before the model is built
            checkpointing.restore_task_state(task, self.ckpt_dir)
        self.engine = make_engine(task, ctx, cfg, resuming=self.resuming)
        self.step = 0
        self.consumed_samples = 0
        self.data: Any = None  # the task's step iterator (made in fit)
        self.resumed_data_state = None  # its state from the checkpoint resumed from, if any
        self.last_checkpoint: Path | None = None
        self.saved_step: int | None = None  # the step of last_checkpoint
        self.resume_changes: dict[str, tuple] = {}  # schedule settings this resume changed: key -> (old, new)
        self.nonfinite_streak = 0  # steps in a row whose update was skipped
        peak = ctx.accelerator.peak_flops(self.engine.dtype)
        self._peak_total = peak * ctx.world_size if peak else None
        seq_length = getattr(self.train, "seq_length", None)  # (a schema without one: no per-token FLOPs)
        self._flops_per_token = task.flops_per_token(seq_length) if seq_length else None

    @property
    def dtype(self):
        return self.engine.dtype

    @property
    def model(self):
        return self.engine.model

    @property
    def inner_model(self):
        return self.engine.inner_model

    # -- one step ---------------------------------------------------------------------------
    def train_step(self, step: StepBatch | list) -> StepResult:
        """Forward, backward and (when the loss and gradient norm are finite) the update of one
        step. A non-finite one skips the update; ``train.nonfinite_patience`` of them in a row raise
        ``NonFiniteError``."""
        if not isinstance(step, StepBatch):
            step = StepBatch(micro_batches=list(step))
        tracks_memory = self.ctx.device.type != "cpu"
        if tracks_memory:
            self.ctx.accelerator.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.train)
        out: StepOutput = self.engine.train_step(step, lr, measuring=bool(getattr(self.data, "measuring", False)))
        bad = next(((k, v) for k, v in (("loss", out.loss), ("grad_norm", out.grad_norm)) if not math.isfinite(v)), None)
        self.ctx.accelerator.synchronize()
        seconds = time.perf_counter() - t0
        self.step += 1
        self.consumed_samples += self.train.global_batch_size
        flops = out.flops
        if flops is None and out.tokens is not None and self._flops_per_token:
            flops = out.tokens * self._flops_per_token
        metrics = dict(step.metrics)
        if out.offloaded_bytes is not None:
            metrics["offload_gib"] = out.offloaded_bytes / 2**30
        if tracks_memory:  # this rank's device memory at its peak in the step (tensors allocated)
            metrics["peak_memory_gib"] = self.ctx.accelerator.memory_stats().peak_allocated / 2**30
        result = StepResult(step=self.step, loss=out.loss, grad_norm=out.grad_norm, lr=lr,
                            samples=self.train.global_batch_size, seconds=seconds, tokens=out.tokens, flops=flops,
                            metrics=metrics, compute_seconds=out.compute_seconds)
        self.nonfinite_streak = self.nonfinite_streak + 1 if bad is not None else 0
        patience = self.train.nonfinite_patience
        if bad is not None and patience and self.nonfinite_streak >= patience:
            raise NonFiniteError(self.step, *bad, self.last_checkpoint, result, streak=self.nonfinite_streak)
        return result

    def metrics(self, result: StepResult) -> dict[str, float]:
        out = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr, "step_time_s": result.seconds,
               "samples_per_s": result.samples / result.seconds, "consumed_samples": self.consumed_samples}
        if result.tokens is not None:
            out["tokens_per_s"] = result.tokens / result.seconds
        if result.flops is not None and self._peak_total:
            out["mfu"] = result.flops / result.seconds / self._peak_total
        out.update(result.metrics)
        return out

    # -- the loop ---------------------------------------------------------------------------
    def _start(self) -> None:
        starting_over = checkpointing.check_fresh_start(self)
        if self.resuming:
            checkpointing.resume(self, self.ckpt_dir)
            self.last_checkpoint = self.ckpt_dir
            self.saved_step = self.step
        elif self.ckpt_cfg.load:
            checkpointing.load_weights(self, self.ckpt_cfg.load)
        # the config is accepted: from here on the run writes
        if starting_over:
            removed = checkpointing.start_over(self)
            if self.ctx.is_main:
                steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in removed)
                self.report(f"checkpoint.overwrite=true: removed the earlier run's checkpoints in {self.ckpt_dir} "
                            f"({f'steps {steps}' if steps else 'what unfinished saves left'})")
        if self.ctx.is_main:
            self._start_record()
            if self.resuming:
                self._record_resume()
        self.data = self.task.steps(self.ctx, self.step)
        if self.resumed_data_state is not None and hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(self.resumed_data_state)

    def _start_record(self) -> None:
        """``config.yaml`` (the composed config, for sampling, export and the record) and
        ``metrics.jsonl`` cut back to the step this run starts at."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config_record:
            from omegaconf import OmegaConf

            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(self.config_record)))
        backup = cut_back(self.run_dir / "metrics.jsonl", self.step)
        if backup is not None and self.step == 0:
            self.report(f"a new run: {self.run_dir / 'metrics.jsonl'} starts empty; the earlier one is kept as "
                        f"{backup.name}")
        elif backup is not None:
            self.report(f"{self.run_dir / 'metrics.jsonl'} cut back to its records up to step {self.step}, where this "
                        f"run resumes; the file as it was is kept as {backup.name}")

    def _record_resume(self) -> None:
        """One line per resume in ``RUN_DIR/resumes.jsonl`` (the step, the time, the schedule settings
        it changed), and the changes said in one line."""
        from loongforge.core.training.resume_settings import describe_changes, record_resume

        record_resume(self.run_dir, self.step, self.resume_changes)
        if self.resume_changes:
            self.report(f"resumed at step {self.step} with {describe_changes(self.resume_changes)}; they apply from "
                        f"step {self.step + 1} on (the optimizer state is the checkpoint's; noted in "
                        f"{self.run_dir / 'resumes.jsonl'})")

    def save(self) -> Path:
        """A checkpoint of this step; refused (``NonFiniteError``) when any rank's weights are not
        finite, and a full or read-only disk is a ``StorageError``: either way the last checkpoint
        stays as it was (``keep_last`` prunes only after a save succeeded)."""
        if not self.weights_finite():
            raise NonFiniteError(self.step, "weights", float("nan"), self.last_checkpoint)
        try:
            self.last_checkpoint = checkpointing.save(self, self.ckpt_dir)
            self.saved_step = self.step
        except OSError as exc:
            kept = f"the last checkpoint {self.last_checkpoint} is intact" if self.last_checkpoint else "none was saved before"
            refused = storage_error(exc, f"checkpoint of step {self.step} not saved under {self.ckpt_dir} ({kept})")
            if refused is None:
                raise
            raise refused from exc
        return self.last_checkpoint

    def weights_finite(self) -> bool:
        """Whether every rank's weights are finite (all ranks call it together)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        flags = [torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()
                 for p in self.engine.model.parameters() if p.numel()]
        bad = (~torch.stack(flags)).any().to(torch.float32) if flags else torch.zeros((), device=self.ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    def fit(self) -> list[StepResult]:
        """Train from where the run stands to ``train.steps`` (or ``train.exit_interval`` steps
        further), saving on the checkpoint cadence and at the end. A stop signal (SIGTERM, SIGUSR1,
        Ctrl-C: ``preemption``) ends it after the step under way, with a checkpoint of that step, by
        ``TrainingStopped``."""
        with StopSignals() as signals:
            return self._fit(signals)

    def _fit(self, signals: StopSignals) -> list[StepResult]:
        self._start()
        end = self.train.steps
        if self.train.exit_interval:
            end = min(end, self.step + self.train.exit_interval)
        results: list[StepResult] = []
        logger = MetricsLogger(self.run_dir, enabled=self.ctx.is_main, tensorboard=self.log_cfg.tensorboard,
                               wandb=self._wandb_run())
        samples_log = self._open_sample_log()
        bar = progress(self.train.steps, "train", enabled=self.ctx.is_main and self.log_cfg.progress, initial=self.step)
        window: list[float] = []  # the finite losses of the steps since the last metrics record
        try:
            while self.step < end:
                stop = agreed_stop(signals.received, self.ctx.device)  # every rank, at every step boundary
                if stop:
                    bar.close()  # the stop's line is the run's last
                    self._stop(stop)
                batch = next(self.data)
                try:
                    result = self.train_step(batch)
                except NonFiniteError as exc:
                    logger.log(exc.step, self.metrics(exc.result))
                    raise
                if result.skipped and self.ctx.is_main:
                    bar.write(f"step {result.step}: loss {result.loss}, grad norm {result.grad_norm}: not finite, "
                              f"update skipped ({self.nonfinite_streak} in a row)")
                metrics = self.metrics(result)
                results.append(result)
                if hasattr(self.data, "record_compute_seconds"):
                    self.data.record_compute_seconds(result.compute_seconds)
                if samples_log is not None and isinstance(batch, StepBatch):
                    samples_log.write(json.dumps({"step": self.step, "dp_rank": self.ctx.dp_rank,
                                                  "ids": [int(i) for i in batch.sample_ids]}) + "\n")
                metrics.update(self._evaluate())
                if math.isfinite(result.loss):
                    window.append(result.loss)
                if window:  # a step's loss is one batch's: their mean since the last record is the trend
                    metrics["loss_avg"] = statistics.fmean(window)
                if self.step % self.log_cfg.interval == 0 or self.step == end:
                    logger.log(self.step, metrics)
                    window = []
                bar.update(1)
                postfix = {"loss": f"{result.loss:.4f}"}
                if "loss_avg" in metrics:
                    postfix["loss_avg"] = f"{metrics['loss_avg']:.4f}"
                if "tokens_per_s" in metrics:
                    postfix["tok_s"] = f"{metrics['tokens_per_s']:.0f}"
                bar.set_postfix(postfix)
                interval = self.ckpt_cfg.interval
                if self.ckpt_cfg.save and ((interval and self.step % interval == 0) or self.step == end):
                    self.save()
        except TrainingStopped:
            raise  # a stop asked for, not a failure: the run resumes
        except BaseException:
            logger.close(failed=True)
            raise
        finally:
            bar.close()
            logger.close()
            if samples_log is not None:
                samples_log.close()
        return results

    def _stop(self, signum: int) -> None:
        """Stop on ``signum`` after this step: a checkpoint of it when a step has finished since the
        last one (every rank, the normal atomic save), one line on the main rank, ``TrainingStopped``."""
        if self.step == self.saved_step:
            kept = f"no step since the last checkpoint (step {self.saved_step}, {self.last_checkpoint})"
        elif not self.ckpt_cfg.save:
            kept = "no checkpoint (checkpoint.save=false)"
        elif self.step == 0:
            kept = "no step had finished: no checkpoint"
        else:
            kept = f"checkpoint {self.save()} saved"
        code = exit_code(signum)
        then = (f"exit {code} (requeue: the same command resumes it)" if code == REQUEUE_EXIT_CODE
                else "the same command resumes it")
        line = f"stopped by {describe(signum)} at step {self.step}: {kept}; {then}"
        if self.ctx.is_main:
            self.report(line)
        raise TrainingStopped(signum, self.step, self.last_checkpoint, line)

    def _wandb_run(self):
        """Rank 0's W&B run with the composed config (``log.wandb``), or None."""
        if not (self.ctx.is_main and getattr(self.log_cfg, "wandb", False)):
            return None
        from loongforge.core.wandb_run import start_wandb_run

        return start_wandb_run(self.log_cfg, self.run_dir, self.config_record, resuming=self.resuming)

    def _evaluate(self) -> dict[str, float]:
        interval = self.eval_cfg.interval if self.eval_cfg is not None else 0
        if not interval or self.step % interval:
            return {}
        return {f"eval/{k}": v for k, v in self.task.evaluate(self.engine.inner_model, self.ctx).items()}

    def _open_sample_log(self):
        """``RUN_DIR/sample_ids/dp_rank_<r>.jsonl`` (appended), written by the first rank of each DP replica."""
        if not self.log_cfg.sample_ids:
            return None
        ctx = self.ctx
        if ctx.tp_rank != 0 or ctx.pp_rank != 0 or ctx.pgs.cp.rank() != 0:
            return None
        directory = self.run_dir / "sample_ids"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"dp_rank_{ctx.dp_rank}.jsonl"
        cut_back(path, self.step)  # each step once, as in metrics.jsonl
        return open(path, "a", buffering=1)

    def data_state_dict(self) -> dict | None:
        """The step iterator's state for the checkpoint (None when it keeps none)."""
        return self.data.state_dict() if self.data is not None and hasattr(self.data, "state_dict") else None
