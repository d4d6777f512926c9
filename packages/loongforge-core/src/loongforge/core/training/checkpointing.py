"""The loop's checkpoints in the core format: the engine's model and optimizer state plus what
the loop owns (step, consumed samples, the task's data-iterator state, every rank's RNG streams)
and the manifest (family, model config, run config, parallel layout, tokenizer).

RNG states and data-iterator states are per rank; they are restored only when the layout is the
same (a resharded run cannot replay the same random streams; the iterator then takes rank 0's
position, which every rank shares).
"""

from __future__ import annotations

from pathlib import Path

from loongforge.core.checkpoint import (
    Checkpoint,
    CheckpointNotFound,
    CheckpointReadError,
    latest_checkpoint,
    save_checkpoint,
    storage,
)
from loongforge.core.training.errors import EarlierRunError


def has_checkpoint(root: str | Path) -> bool:
    return latest_checkpoint(root) is not None if Path(root).exists() else False


def check_fresh_start(trainer) -> bool:
    """A run that does not resume may write into its checkpoint directory only when that holds no
    earlier run's checkpoints, or when told to start over (``checkpoint.overwrite=true``); returns
    whether it starts over (``start_over`` then removes them). Every rank checks alike."""
    root, cfg = trainer.ckpt_dir, trainer.ckpt_cfg
    if trainer.resuming or not storage.holds_checkpoints(root):
        return False
    if cfg.overwrite:
        return True
    pointer = root / storage.LATEST
    where = f"checkpoint.dir={root}" if cfg.dir else f"{root} (log.run_dir={trainer.run_dir})"
    if pointer.is_file():
        what = f"(latest is {pointer.read_text().strip()}) and this run does not resume them (checkpoint.resume=false)"
        resume = "resume it (checkpoint.resume=true), "
    else:  # step directories without the pointer a resume reads
        what = "(step directories, but no latest pointer to resume from)"
        resume = ""
    raise EarlierRunError(f"{where} holds the checkpoints of an earlier run {what}; {resume}start over with "
                          f"checkpoint.resume=false checkpoint.overwrite=true (removes them first), or choose another "
                          f"log.run_dir")


def start_over(trainer) -> list[Path]:
    """Remove the earlier run's checkpoints (global rank 0; every rank waits for it). Returns the
    step directories removed."""
    import torch.distributed as dist

    removed = storage.remove_checkpoints(trainer.ckpt_dir) if trainer.ctx.is_main else []
    if dist.is_initialized():
        dist.barrier()
    return removed


def save(trainer, root: str | Path) -> Path:
    engine, task = trainer.engine, trainer.task
    state = engine.checkpoint_state()
    per_rank = {
        **state.objects,
        "rng": engine.rng_state(),
        "step": trainer.step,
        "consumed_samples": trainer.consumed_samples,
        "data": trainer.data_state_dict(),  # the step iterator's position/plan state (None: it keeps none)
    }
    manifest = {
        "family": task.family,
        "engine": engine.name,
        "model_config": task.model_config_dict(),
        "config": trainer.config_record,
        "layout": engine.layout_record(),
        "consumed_samples": trainer.consumed_samples,
        "tokenizer": task.tokenizer_ref(),
        **task.manifest_fields(),
        **state.manifest,
    }
    return save_checkpoint(root, trainer.step, state.pieces, manifest=manifest, objects=per_rank,
                           keep_last=trainer.ckpt_cfg.keep_last or None)


def restore_task_state(task, root: str | Path) -> None:
    """``task.restore(manifest)`` with the latest checkpoint's manifest, for a task that saves
    state of its own through ``manifest_fields()`` which its model build depends on (e.g. a plan
    measured at the start of the run); called before the engine builds the model."""
    from loongforge.core.checkpoint import read_manifest

    latest = latest_checkpoint(root)
    if latest is None:
        raise CheckpointNotFound(f"{root}: no checkpoint to restore the task's state from")
    task.restore(read_manifest(latest))


def check_model_config(ckpt: Checkpoint, task) -> None:
    saved, current = ckpt.manifest.get("model_config", {}), task.model_config_dict()
    diff = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)}
    if diff:
        section = task.model_section  # the config group the model config lives in
        prefix = f"{section}." if section else ""
        detail = ", ".join(f"{prefix}{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
        raise CheckpointReadError(f"{ckpt.directory / 'manifest.json'}: model config does not match ({detail})")


def open_for_task(task, path, what: str | None = None) -> Checkpoint:
    """The checkpoint at ``path``, refused unless it holds ``task``'s family and model config."""
    ckpt = Checkpoint(path)
    family = ckpt.manifest.get("family")
    if family != task.family:
        where = f"{what}: " if what else ""
        raise CheckpointReadError(f"{where}{ckpt.directory / 'manifest.json'}: a {family!r} checkpoint; this run "
                                  f"trains {task.family!r}")
    check_model_config(ckpt, task)
    return ckpt


def check_lora(ckpt: Checkpoint, config_record: dict) -> None:
    """A run resumes with the LoRA adapters it was trained with (``lora.rank``,
    ``lora.target_modules``): the checkpoint's tensors and optimizer state are those adapters'."""
    if "lora" not in config_record:  # a config without a lora group (or none recorded)
        return
    from loongforge.core.lora import lora_record

    saved = _adapters(lora_record(ckpt.manifest))
    current = _adapters(lora_record({"config": config_record}))
    if saved == current:
        return
    rank, targets = saved
    trained = (f"with LoRA rank {rank} (lora.rank={rank} lora.target_modules={targets})" if rank
               else "without LoRA (lora.rank=0: every weight trained)")
    rank, targets = current
    given = f"lora.rank={rank} lora.target_modules={targets}" if rank else "lora.rank=0"
    raise CheckpointReadError(f"cannot resume from {ckpt.directory}: this run was trained {trained}, the config has "
                              f"{given}; resume with the run's LoRA settings or start another run (another log.run_dir)")


def _adapters(record: dict | None) -> tuple[int, list[str]]:
    """``(rank, target_modules)`` of a ``lora`` record; ``(0, [])`` without adapters."""
    return (int(record["rank"]), list(record.get("target_modules") or [])) if record else (0, [])


def _open(trainer, path) -> Checkpoint:
    return open_for_task(trainer.task, path)


def resume(trainer, root: str | Path) -> None:
    """Everything, from ``root``'s latest checkpoint, with this run's schedule settings
    (``resume_settings``: what may change, what is refused)."""
    from loongforge.core.training.resume_settings import check_fixed_settings, schedule_changes

    ckpt = _open(trainer, root)
    check_lora(ckpt, trainer.config_record)
    saved_config = ckpt.manifest.get("config") or {}
    check_fixed_settings(saved_config, trainer.config_record, ckpt.directory)
    try:
        trainer.task.check_resume(ckpt.manifest)
    except ValueError as exc:
        raise CheckpointReadError(f"cannot resume from {ckpt.directory}: {exc}") from exc
    engine = trainer.engine
    engine.load_checkpoint(ckpt, with_optimizer=True)
    same_layout = ckpt.manifest.get("layout") == engine.layout_record()
    mine = ckpt.objects(engine.ctx.rank) if same_layout else ckpt.objects(0)
    trainer.step = int(mine["step"])
    trainer.consumed_samples = int(mine["consumed_samples"])
    trainer.resumed_data_state = mine.get("data")
    if same_layout:
        engine.set_rng_state(mine["rng"])
    trainer.resume_changes = schedule_changes(saved_config, trainer.config_record)


def load_weights(trainer, path: str | Path) -> None:
    """Initial weights only (fine-tuning from a checkpoint): no optimizer, step 0."""
    trainer.engine.load_checkpoint(_open(trainer, path), with_optimizer=False)
