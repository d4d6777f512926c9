"""Training state <-> the LoongForge checkpoint format (``loongforge.core.checkpoint``).

Tensors are stored under their diffusers names: ``model.<expert>.<param>`` (``expert`` is
``transformer`` / ``transformer_2``), ``ema.<expert>.<param>``, and AdamW's
``optim.<expert>.<param>.exp_avg`` / ``.exp_avg_sq``. Under FSDP2 every rank writes its dim-0
shard of each tensor as a piece of the global tensor; under DDP rank 0 writes whole tensors. Any
layout loads any other (pieces are read by region). The per-parameter Adam step counts and the
step live in the manifest/objects. Data order and noise derive from (seed, step), so the step is
the whole data position.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge.core.checkpoint import Checkpoint, Piece, save_checkpoint
from loongforge.diffusion.sharding import is_dtensor, local, region

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _pieces(key: str, like: torch.Tensor, data: torch.Tensor, write_whole: bool) -> list[Piece]:
    if is_dtensor(like):
        offset, shape = region(like)
        return [Piece(key, tuple(like.shape), offset, data.detach())] if shape[0] else []
    return [Piece(key, tuple(like.shape), (0,) * like.dim(), data.detach())] if write_whole else []


def save(trainer, root) -> None:
    main = trainer.ctx.is_main
    pieces: list[Piece] = []
    steps: dict[str, float] = {}
    for name, expert in trainer.experts_by_name.items():
        for key, t in expert.state_dict().items():
            pieces += _pieces(f"model.{name}.{key}", t, local(t), main)
    for full, p in trainer.named_trainable.items():
        st = trainer.optimizer.state.get(p)
        if st:
            steps[full] = float(st["step"])
            for k in ADAM_KEYS:
                pieces += _pieces(f"optim.{full}.{k}", p, local(st[k]), main)
        if trainer.ema is not None:
            pieces += _pieces(f"ema.{full}", p, trainer.ema.shadow[full], main)
    save_checkpoint(
        root,
        trainer.step,
        pieces,
        manifest={**trainer.manifest_fields(), "adam_steps": steps},
        keep_last=trainer.recipe.checkpoint.keep_last or None,
    )


@torch.no_grad()
def _fill(target: torch.Tensor, reader, key: str) -> None:
    offset, shape = region(target)
    if shape and shape[0] == 0:
        return
    value = reader.read(key, offset, shape)
    local(target).copy_(value.to(local(target).dtype))


def load_model(experts_by_name: dict, ckpt: Checkpoint, prefix: str = "model.") -> None:
    """Fill every expert's weights from ``prefix<expert>.<param>`` tensors."""
    for name, expert in experts_by_name.items():
        for key, t in expert.state_dict().items():
            _fill(t, ckpt.reader, f"{prefix}{name}.{key}")


def load(trainer, path) -> None:
    ckpt = Checkpoint(path)
    load_model(trainer.experts_by_name, ckpt)
    steps = ckpt.manifest.get("adam_steps", {})
    for full, p in trainer.named_trainable.items():
        if trainer.ema is not None:
            key = f"ema.{full}"
            if key in ckpt.reader.keys():
                offset, shape = region(p)
                if shape[0]:
                    trainer.ema.shadow[full].copy_(ckpt.reader.read(key, offset, shape).float())
        if full not in steps:
            continue
        state = {"step": torch.tensor(steps[full], dtype=torch.float32)}
        for k in ADAM_KEYS:
            buf = torch.zeros_like(p)
            _fill(buf, ckpt.reader, f"optim.{full}.{k}")
            state[k] = buf
        trainer.optimizer.state[p] = state
    trainer.step = ckpt.step
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
