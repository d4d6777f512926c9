"""The megatron-core engine's state <-> the core checkpoint format: model and optimizer (the
distributed optimizer's shards included) as layout-independent pieces of megatron's sharded
state dicts (see ``checkpoint.sharded``), so a checkpoint saved under one TP/PP/DP layout loads
under another. The loop adds the step, the data position and the RNG streams
(``loongforge.core.training.checkpointing``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loongforge.core.checkpoint import Checkpoint, CheckpointReadError
from loongforge.core.checkpoint.sharded import flatten_for_save, load_into, move_tensors
from loongforge.core.training.engine import EngineState, check_precision

if TYPE_CHECKING:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

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


def _sharded_state_dict(engine, is_loading: bool, with_optimizer: bool = True) -> dict:
    if is_loading and with_optimizer:
        _prime_adam_state(engine.optimizer)
    model_sd = engine.inner_model.sharded_state_dict()
    out = {"model": model_sd}
    if with_optimizer:
        out["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_METADATA)
    return out


def engine_state(engine) -> EngineState:
    """The model and optimizer pieces of this rank, rank 0's common objects, the optimizer kind."""
    pieces, objects, common = flatten_for_save(_sharded_state_dict(engine, is_loading=False))
    per_rank = {"sharded_objects": objects}
    if engine.ctx.rank == 0:
        per_rank["common"] = common
    return EngineState(pieces=pieces, objects=per_rank,
                       manifest={"optimizer": _optimizer_kind(engine), "precision": engine.precision})


def _optimizer_kind(engine) -> str:
    return "distributed" if engine.train.use_distributed_optimizer else "standard"


def _check_optimizer_kind(ckpt: Checkpoint, engine) -> None:
    saved = ckpt.manifest.get("optimizer")
    if saved != _optimizer_kind(engine):
        raise CheckpointReadError(
            f"{ckpt.directory / 'manifest.json'}: optimizer state was saved by the {saved} optimizer; this run uses "
            f"the {_optimizer_kind(engine)} one (set train.use_distributed_optimizer to match, or load weights only "
            f"with checkpoint.load=DIR and checkpoint.resume=false)"
        )


def _all_objects(ckpt: Checkpoint) -> tuple[dict, dict]:
    objects, common = {}, {}
    for rank in range(int(ckpt.manifest.get("world_size", 1))):
        data = ckpt.objects(rank)
        objects.update(data.get("sharded_objects", {}))
        if "common" in data:
            common = data["common"]
    return objects, common


def _sub_optimizer_states(optimizer: MegatronOptimizer, state_dict: dict) -> list[tuple[MegatronOptimizer, dict]]:
    """``(optimizer, its state dict)`` per megatron sub-optimizer, as ``ChainedOptimizer``
    pairs them (one optimizer: the whole dict; several: entries in index order)."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(optimizers) == 1:
        return [(optimizers[0], state_dict)]
    return list(zip(optimizers, (state_dict[k] for k in sorted(state_dict))))


# megatron's per-group LR-scheduler values; this loop's schedule is ``train.*`` (``schedule.lr_at``)
SCHEDULE_GROUP_KEYS = ("max_lr", "min_lr")


def _group_identity(group: dict) -> tuple:
    """What pairs a saved param group with the optimizer's: megatron's identifier keys less the
    schedule values (a missing key and None alike, as megatron takes them)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(key, group.get(f"pre_{key}")) for key in param_group_identifier_keys
                 if key not in SCHEDULE_GROUP_KEYS)


def _take_this_runs_schedule(optimizer, state_dict: dict) -> None:
    """Saved param groups carry the LR their run was started with (``max_lr``, ``min_lr``), and
    megatron pairs saved groups with the optimizer's by keys that include them, so a resume with
    another ``train.lr`` would find no group. The loop, not megatron's scheduler, sets the LR: each
    saved group takes the values of the optimizer's group it pairs with by the other keys."""
    for opt, sd in _sub_optimizer_states(optimizer, state_dict):
        saved_groups = (sd["optimizer"] if "optimizer" in sd else sd)["param_groups"]
        current = {_group_identity(group): group for group in opt.optimizer.param_groups}
        for group in saved_groups:
            mine = current.get(_group_identity(group))
            if mine is not None:
                group.update({key: mine.get(key) for key in SCHEDULE_GROUP_KEYS})


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
    _take_this_runs_schedule(optimizer, state_dict)
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


def load(engine, ckpt: Checkpoint, with_optimizer: bool) -> None:
    """Fill the model (and the optimizer, the distributed optimizer's shards included) from ``ckpt``.
    Weights only (``with_optimizer=False``): a mixed-precision optimizer keeps fp32 main copies of
    the params, made when it was built; they are refreshed from the loaded weights, or its first
    step would write the initial weights back."""
    objects, common = _all_objects(ckpt)
    if with_optimizer:
        _check_optimizer_kind(ckpt, engine)
        check_precision(ckpt, engine.precision)
    else:
        common = {k: v for k, v in common.items() if k == "model"}
    state = load_into(_sharded_state_dict(engine, is_loading=True, with_optimizer=with_optimizer), ckpt.reader, objects, common)
    move_tensors(state, engine.ctx.device)
    engine.inner_model.load_state_dict(state["model"], strict=True)
    if with_optimizer:
        _load_optimizer(engine.optimizer, state["optimizer"], ckpt.directory)
        engine.set_group_hyperparameters()  # the saved groups' AdamW settings give way to this run's
    else:
        engine.optimizer.reload_model_params()
