"""The PyTorch-native engine's state <-> the core checkpoint format.

Tensors are stored under the model's own state-dict names: ``model.<name>`` (parameters and
buffers), ``ema.<name>`` (EMA weights of the trained parameters) and ``optim.<name>.<state>``
(AdamW's ``exp_avg`` / ``exp_avg_sq``); the per-parameter Adam step counts go to the manifest
(``adam_steps``). Under FSDP2/HSDP every rank writes its dim-0 shard of each tensor as a piece of
the global tensor (one replica group of an HSDP mesh writes); under DDP the main rank writes whole
tensors. Pieces are read back by region, so any layout loads any other (DDP <-> FSDP2 <-> HSDP,
any world size), and nothing is gathered on one rank.

A LoRA run (``lora.rank > 0``) saves its base weights under their names and its adapters as
``model.<layer>.lora_A.weight`` / ``lora_B.weight``, with the ``lora`` group in the manifest;
its optimizer and EMA state cover the adapters only. A checkpoint without adapters loads into a
LoRA model as its base weights (``checkpoint.load``, ``lora.base``), the adapters kept as they are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge.core.checkpoint import Checkpoint, CheckpointReadError, Piece
from loongforge.core.training.engine import EngineState, check_precision
from loongforge.core.training.sharding import local, region, writes_piece

MODEL, EMA_PREFIX, OPTIM = "model.", "ema.", "optim."


def _piece(key: str, like: torch.Tensor, data: torch.Tensor, is_main: bool) -> list[Piece]:
    if not writes_piece(like, is_main):
        return []
    offset, _ = region(like)
    return [Piece(key, tuple(like.shape), offset, data.detach())]


def engine_state(engine) -> EngineState:
    is_main = engine.ctx.is_main
    pieces: list[Piece] = []
    for key, t in engine.model.state_dict().items():
        pieces += _piece(MODEL + key, t, local(t), is_main)
    steps: dict[str, float] = {}
    for name, p in engine.named_trainable.items():
        state = engine.optimizer.state.get(p)
        if state:
            steps[name] = float(state["step"])
            for k, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    pieces += _piece(f"{OPTIM}{name}.{k}", p, local(value), is_main)
        if engine.ema is not None:
            pieces += _piece(EMA_PREFIX + name, p, engine.ema.shadow[name], is_main)
    manifest = {"adam_steps": steps, "ema": engine.ema is not None, "precision": engine.precision}
    lora = engine.lora
    if lora is not None:
        manifest["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                            "target_modules": list(lora.target_modules), "layers": list(engine.adapted)}
    return EngineState(pieces=pieces, manifest=manifest)


@torch.no_grad()
def _read_into(buffer: torch.Tensor, like: torch.Tensor, ckpt: Checkpoint, key: str) -> None:
    """Fill ``buffer``, this rank's part of a tensor shaped and sharded like ``like``, from ``key``."""
    if key not in ckpt.reader.keys():
        raise CheckpointReadError(f"{ckpt.directory / 'manifest.json'}: no tensor {key!r}")
    offset, shape = region(like)
    if shape and shape[0] == 0:
        return
    buffer.copy_(ckpt.reader.read(key, offset, shape).to(buffer.dtype))


def load_model(model: torch.nn.Module, ckpt: Checkpoint, prefix: str = MODEL) -> None:
    """Fill every tensor of ``model``'s state dict (whole or FSDP2 shard) from ``prefix<name>``;
    a model with LoRA adapters takes only its base weights from a checkpoint that has none."""
    from loongforge.core.lora import is_adapter_key

    keys = ckpt.reader.keys()
    base_only = not any(is_adapter_key(k) for k in keys if k.startswith(prefix))
    state = model.state_dict()
    if not base_only and not any(is_adapter_key(k) for k in state):
        raise CheckpointReadError(f"{ckpt.directory}: a checkpoint with LoRA adapters (lora.rank="
                                  f"{(ckpt.manifest.get('lora') or {}).get('rank')}); this model has none (lora.rank=0)")
    for key, t in state.items():
        if base_only and is_adapter_key(key):
            continue
        _read_into(local(t), t, ckpt, prefix + key)


def load_base(engine, path) -> None:
    """``lora.base``: the base weights of a checkpoint of the same family and model config (one
    without adapters) into the LoRA model, before its first step."""
    from loongforge.core.lora import is_adapter_key
    from loongforge.core.training.checkpointing import open_for_task

    ckpt = open_for_task(engine.task, path, what=f"lora.base={path}")
    if any(is_adapter_key(k) for k in ckpt.reader.keys()):
        raise CheckpointReadError(f"lora.base={path}: a checkpoint with LoRA adapters; merge them first "
                                  "(the modality's `convert` of it) or continue it with checkpoint.load")
    load_model(engine.model, ckpt)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load(engine, ckpt: Checkpoint, with_optimizer: bool) -> None:
    if with_optimizer:
        check_precision(ckpt, engine.precision)
    load_model(engine.model, ckpt)
    if with_optimizer:
        steps = ckpt.manifest.get("adam_steps", {})
        fused = bool(engine.optimizer.defaults.get("fused"))  # fused AdamW keeps its step counts on the device
        for name, p in engine.named_trainable.items():
            if engine.ema is not None and EMA_PREFIX + name in ckpt.reader.keys():
                _read_into(engine.ema.shadow[name], p, ckpt, EMA_PREFIX + name)
            if name not in steps:
                continue
            state = {"step": torch.tensor(steps[name], dtype=torch.float32, device=p.device if fused else "cpu")}
            for k in ("exp_avg", "exp_avg_sq"):
                buf = torch.zeros_like(p)
                _read_into(local(buf), p, ckpt, f"{OPTIM}{name}.{k}")
                state[k] = buf
            engine.optimizer.state[p] = state
        engine.updates = ckpt.step
    if dist.is_available() and dist.is_initialized():
        dist.barrier()

