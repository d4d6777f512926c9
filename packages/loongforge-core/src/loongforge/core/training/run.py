"""One training run from a validated config: the process groups of ``cfg.parallel``, the loop over
the task, a summary line, and the groups torn down again (also when the run fails).

Every ``lf-* train`` ends here; the config and the task are built first, so a bad config or bad
data fails before any process group exists, and so do ``log.wandb=true`` without the wandb
package and a ``log.run_dir`` or ``checkpoint.dir`` that names a file. The job then takes its run
directory (``run_dir.RunDirLock``, by global rank 0, every rank told the outcome): a run directory
trains one run at a time, and is given back when the run ends, also when it fails. A CUDA run
without a kernel wheel says so in one line (``reference_kernels_notice``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loongforge.core.config import to_dict
from loongforge.core.errors import UserError
from loongforge.core.training.loop import StepResult, Trainer
from loongforge.core.training.run_dir import Holder, RunDirLock, check_run_directories


@dataclass
class RunSummary:
    run_dir: Path
    checkpoint_dir: Path
    start_step: int
    results: list[StepResult]
    last_checkpoint: Path | None
    is_main: bool = True  # this process prints for the job (global rank 0)

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.results]


def describe_layout(ctx) -> str:
    return (f"{ctx.accelerator.name} x{ctx.world_size} (tp={ctx.layout.tp} pp={ctx.layout.pp} cp={ctx.layout.cp} "
            f"ep={ctx.layout.ep} dp={ctx.dp_size})")


def run_training(cfg, task, prog: str, after: Callable[[Trainer], None] | None = None) -> RunSummary:
    """Train ``task`` as ``cfg`` says (``prog`` prefixes the printed lines); ``after(trainer)`` runs
    once training has finished, before the groups are torn down (e.g. an export). Groups this call
    made are torn down at the end; a process that was already in a group stays in it (and may run
    again)."""
    import torch.distributed as dist

    from loongforge.core.kernels.registry import installed_kernel_providers, reference_kernels_notice
    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.core.wandb_run import require_wandb

    require_wandb(cfg.log)  # before any process group
    check_run_directories(cfg)
    owned = not dist.is_initialized()
    p = cfg.parallel
    ctx = init_parallel(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, seed=cfg.train.seed, timeout_s=p.timeout_s,
                        engine=task.engine)
    lock = RunDirLock(cfg.log.run_dir)
    try:
        previous = claim_run_dir(lock, ctx)
        if previous is not None and ctx.is_main:
            print(f"{prog}: {cfg.log.run_dir} was held by {previous}, which is no longer running; this run takes "
                  f"it over", flush=True)
        task.prepare(ctx)  # collective set-up (e.g. a data index every rank builds together)
        trainer = Trainer(task, ctx, cfg, config_record=to_dict(cfg),
                          report=lambda line: print(f"{prog}: {line}", flush=True))
        if ctx.is_main:
            print(f"{prog}: {task.describe()} on {describe_layout(ctx)}, {trainer.engine.name} engine, {trainer.dtype} "
                  f"({trainer.engine.precision} precision), "
                  f"run dir {cfg.log.run_dir}", flush=True)
            notice = reference_kernels_notice(ctx.accelerator.name, installed_kernel_providers(),
                                              prog.replace("lf-", "loongforge-"))
            if notice:
                print(f"{prog}: {notice}", flush=True)
        results = trainer.fit()
        if after is not None:
            after(trainer)
        summary = RunSummary(trainer.run_dir, trainer.ckpt_dir, trainer.step - len(results), results,
                             trainer.last_checkpoint, ctx.is_main)
        if ctx.is_main:
            print_summary(prog, summary)
        return summary
    finally:
        lock.release()
        if owned:
            destroy_parallel()


def claim_run_dir(lock: RunDirLock, ctx) -> Holder | None:
    """Global rank 0 takes the run directory; every rank raises the same ``RunDirBusyError`` when it
    is held. Returns the gone holder rank 0 took it over from (None elsewhere)."""
    import torch.distributed as dist

    outcome: Holder | UserError | None = None
    if ctx.is_main:
        try:
            outcome = lock.acquire()
        except UserError as exc:
            outcome = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0] if not ctx.is_main else outcome
    if isinstance(outcome, UserError):
        raise outcome
    return outcome if ctx.is_main else None


def loss_trend(results: list[StepResult]) -> str:
    """The mean loss of the run's first and last tenth of steps (at least 2 steps each): a step's
    loss is one batch's, so with small batches two single steps say little about the trend."""
    if len(results) < 10:
        return ""
    n = max(2, len(results) // 10)
    first, last = results[:n], results[-n:]
    return (f"mean loss of steps {first[0].step}-{first[-1].step} {statistics.fmean(r.loss for r in first):.4f} -> "
            f"steps {last[0].step}-{last[-1].step} {statistics.fmean(r.loss for r in last):.4f} "
            f"(each step's loss is one batch's; metrics.jsonl's loss_avg is the mean since its previous record)")


def print_summary(prog: str, summary: RunSummary) -> None:
    results = summary.results
    if not results:
        print(f"{prog}: nothing to do: {summary.run_dir} is already at step {summary.start_step}", flush=True)
        return
    late = results[len(results) // 2:]
    rate = (f"median {statistics.median([(r.tokens or 0) / r.seconds for r in late]):.0f} tokens/s" if results[-1].tokens is not None
            else f"median {statistics.median([r.samples / r.seconds for r in late]):.1f} samples/s")
    print(f"{prog}: step {results[0].step} loss {results[0].loss:.4f} -> step {results[-1].step} loss "
          f"{results[-1].loss:.4f}; {rate}", flush=True)
    trend = loss_trend(results)
    if trend:
        print(f"{prog}: {trend}", flush=True)
    where = f"last checkpoint {summary.last_checkpoint}" if summary.last_checkpoint else "no checkpoint saved"
    print(f"{prog}: run dir {summary.run_dir} (metrics.jsonl, config.yaml); {where}", flush=True)
    resume = (f"resume: the same command (it continues from {summary.checkpoint_dir / 'latest'}); "
              if summary.last_checkpoint else "")
    print(f"{prog}: {resume}curves: {prog} plot {summary.run_dir}", flush=True)
