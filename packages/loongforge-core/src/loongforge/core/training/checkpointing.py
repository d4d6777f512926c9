"""Saving and resuming the megatron trainer: model, optimizer (incl. distributed-optimizer
shards), LR scheduler, RNG states and the data position (with the state of the task's step
iterator, e.g. the balanced sampler's plan state), in the core checkpoint format.

Model and optimizer tensors are stored as layout-independent pieces (see
``checkpoint.sharded``), so a checkpoint saved under one TP/PP/DP layout loads under another.
RNG states are per rank and restored only when the layout is the same (a resharded run cannot
replay the same random streams anyway).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge.core.checkpoint import Checkpoint, CheckpointReadError, latest_checkpoint, save_checkpoint
from loongforge.core.checkpoint.sharded import flatten_for_save, load_into, move_tensors

OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _prime_adam_state(optimizer) -> None:
    """A fresh optimizer has no state; megatron's distributed optimizer (without TE/Apex) reads
    each param's Adam ``step`` when it builds a loading state dict. Give every param zero state
    first, the same values a first ``step()`` would start from; the load then overwrites them."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                    st["step"] = torch.zeros((), dtype=torch.float32)


def _sharded_state_dict(trainer, is_loading: bool, with_optimizer: bool = True) -> dict:
    if is_loading and with_optimizer:
        _prime_adam_state(trainer.optimizer)
    model_sd = trainer.inner_model.sharded_state_dict()
    out = {"model": model_sd}
    if with_optimizer:
        out["optimizer"] = trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_METADATA)
    return out


def _rng_state(trainer) -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if trainer.ctx.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(trainer, state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if "cuda" in state and trainer.ctx.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def layout_record(ctx) -> dict:
    return {"tp": ctx.layout.tp, "pp": ctx.layout.pp, "cp": ctx.layout.cp, "ep": ctx.layout.ep,
            "dp": ctx.dp_size, "world_size": ctx.world_size}


def has_checkpoint(root: str | Path) -> bool:
    return latest_checkpoint(root) is not None if Path(root).exists() else False


def save(trainer, root: str | Path) -> Path:
    ctx = trainer.ctx
    pieces, objects, common = flatten_for_save(_sharded_state_dict(trainer, is_loading=False))
    per_rank = {
        "sharded_objects": objects,
        "rng": _rng_state(trainer),
        "scheduler": trainer.scheduler.state_dict(),
        "step": trainer.step,
        "consumed_samples": trainer.consumed_samples,
        "data": trainer.data_state_dict(),  # the step iterator's position/plan state (None: it keeps none)
    }
    if ctx.rank == 0:
        per_rank["common"] = common
    manifest = {
        "family": trainer.task.family,
        "model_config": trainer.task.model_config_dict(),
        "config": trainer.config_record,
        "layout": layout_record(ctx),
        "optimizer": _optimizer_kind(trainer),
        "consumed_samples": trainer.consumed_samples,
        "tokenizer": getattr(trainer.task, "tokenizer_ref", lambda: None)(),
    }
    return save_checkpoint(root, trainer.step, pieces, manifest=manifest, objects=per_rank,
                           keep_last=trainer.ckpt_cfg.keep_last or None)


def _optimizer_kind(trainer) -> str:
    return "distributed" if trainer.train.use_distributed_optimizer else "standard"


def _check_optimizer_kind(ckpt: Checkpoint, trainer) -> None:
    saved = ckpt.manifest.get("optimizer")
    if saved != _optimizer_kind(trainer):
        raise CheckpointReadError(
            f"{ckpt.directory / 'manifest.json'}: optimizer state was saved by the {saved} optimizer; this run uses "
            f"the {_optimizer_kind(trainer)} one (set train.use_distributed_optimizer to match, or load weights only "
            f"with checkpoint.load=DIR and checkpoint.resume=false)"
        )


def _check_model_config(ckpt: Checkpoint, trainer) -> None:
    saved, current = ckpt.manifest.get("model_config", {}), trainer.task.model_config_dict()
    diff = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)}
    if diff:
        detail = ", ".join(f"model.{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
        raise CheckpointReadError(f"{ckpt.directory / 'manifest.json'}: model config does not match ({detail})")


def _all_objects(ckpt: Checkpoint) -> tuple[dict, dict]:
    objects, common = {}, {}
    for rank in range(int(ckpt.manifest.get("world_size", 1))):
        data = ckpt.objects(rank)
        objects.update(data.get("sharded_objects", {}))
        if "common" in data:
            common = data["common"]
    return objects, common


def _load(trainer, path, with_optimizer: bool) -> Checkpoint:
    ckpt = Checkpoint(path)
    _check_model_config(ckpt, trainer)
    objects, common = _all_objects(ckpt)
    if with_optimizer:
        _check_optimizer_kind(ckpt, trainer)
    else:
        common = {k: v for k, v in common.items() if k == "model"}
    state = load_into(_sharded_state_dict(trainer, is_loading=True, with_optimizer=with_optimizer), ckpt.reader, objects, common)
    move_tensors(state, trainer.ctx.device)
    trainer.inner_model.load_state_dict(state["model"], strict=True)
    if with_optimizer:
        _load_optimizer(trainer.optimizer, state["optimizer"], ckpt.directory)
    return ckpt


def _sub_optimizer_states(optimizer, state_dict) -> list[tuple[object, dict]]:
    """``(optimizer, its state dict)`` per megatron sub-optimizer, as ``ChainedOptimizer``
    pairs them (one optimizer: the whole dict; several: entries in index order)."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(optimizers) == 1:
        return [(optimizers[0], state_dict)]
    return list(zip(optimizers, (state_dict[k] for k in sorted(state_dict))))


def _load_optimizer(optimizer, state_dict: dict, source: Path) -> None:
    """Load megatron optimizer state, the distributed optimizer's parameter state included.

    megatron's distributed optimizer, running on torch's Adam (no TransformerEngine/Apex), loads
    its param groups by giving every parameter's state one shared ``step`` tensor taken from the
    groups, then copies the per-parameter tensors (``fully_reshardable``) into *every* tensor of
    that state, ``step`` included, which the saved parameter state does not carry (KeyError
    'step'). So the parameter state is loaded here as a second phase, with ``step`` set aside
    while megatron copies the other tensors. Afterwards each parameter gets its own ``step``
    tensor: a shared one would be advanced once per parameter by the next ``step()``.
    """
    param_states = []
    for opt, sd in _sub_optimizer_states(optimizer, state_dict):
        if "param_state" in sd:
            kind = sd.pop("param_state_sharding_type")
            if kind != OPTIM_METADATA["distrib_optim_sharding_type"]:
                raise CheckpointReadError(f"{source}: distributed optimizer state of sharding type {kind!r}; expected "
                                          f"{OPTIM_METADATA['distrib_optim_sharding_type']!r}")
            param_states.append((opt, sd.pop("param_state")))
    optimizer.load_state_dict(state_dict)
    for opt, param_state in param_states:
        steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            opt.optimizer.state[p]["step"] = step
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for st in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def load(trainer, root: str | Path) -> None:
    """Resume: everything, from ``root``'s latest checkpoint."""
    ckpt = _load(trainer, root, with_optimizer=True)
    mine = ckpt.objects(trainer.ctx.rank) if ckpt.manifest.get("layout") == layout_record(trainer.ctx) else ckpt.objects(0)
    trainer.scheduler.load_state_dict(mine["scheduler"])
    trainer.step = int(mine["step"])
    trainer.consumed_samples = int(mine["consumed_samples"])
    trainer.resumed_data_state = mine.get("data")
    if ckpt.manifest.get("layout") == layout_record(trainer.ctx):
        _set_rng_state(trainer, mine["rng"])


def load_weights(trainer, path: str | Path) -> None:
    """Initial weights only (fine-tuning from a checkpoint): no optimizer, step 0. A mixed-precision
    optimizer keeps fp32 main copies of the params, made when it was built; they are refreshed from
    the loaded weights, or its first step would write the initial weights back."""
    _load(trainer, path, with_optimizer=False)
    trainer.optimizer.reload_model_params()
