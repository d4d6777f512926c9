"""The embodied training loop (PyTorch-native DDP / FSDP2 / HSDP).

Per step: this rank's slice of global batch ``s`` (``StepBatchSampler``), noise and times of
global batch ``s`` (``draw_noise_and_time``), the per-element flow-matching loss masked to real
action dimensions and in-episode chunk steps, normalised by the *global* number of valid
elements (so any data-parallel split gives the loss and gradients of one process on the whole
batch), gradient clipping, AdamW with warmup + cosine LR. Rank 0 logs (every ``log_every`` steps: mean loss over those
steps, last step's loss, grad norm, LR, samples/s) to ``RUN_DIR/metrics.jsonl`` and TensorBoard; checkpoints go to ``RUN_DIR/checkpoints``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from loongforge.core.checkpoint import Checkpoint
from loongforge.core.config import to_dict
from loongforge.core.distributed import DistributedProcess, init_distributed
from loongforge.core.metrics import MetricsLogger, progress
from loongforge.embodied.checkpointing import find_resume_checkpoint, load_training_state, save_training_state
from loongforge.embodied.config import DatasetConfig, PolicyConfig, TrainConfig
from loongforge.embodied.convert.lerobot_pi05 import from_lerobot_pi05
from loongforge.embodied.data.dataset import EmbodiedDataset
from loongforge.embodied.data.sampler import StepBatchSampler
from loongforge.embodied.data.synthetic import ensure_synthetic_dataset
from loongforge.embodied.parallel import (
    all_reduce_sum,
    barrier,
    compute_precision,
    parallelize,
    resolve_mode,
    unwrap,
)
from loongforge.embodied.policies.flow_matching import draw_noise_and_time
from loongforge.embodied.policies.registry import build_policy


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    losses: list[float]  # global mean loss of each step run here


def resolve_dataset_root(cfg: DatasetConfig, env: DistributedProcess) -> str:
    """``dataset.root``, or the synthetic demo dataset (written by rank 0 on first use)."""
    if cfg.root is not None:
        return cfg.root
    if env.is_main:
        ensure_synthetic_dataset()
    barrier()
    return str(ensure_synthetic_dataset())


def lr_at(step: int, total: int, cfg) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total - cfg.warmup_steps)
    progress_frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress_frac))


def loss_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, chunk, A]`` float: in-episode chunk steps x real action dimensions."""
    return ((~batch["action_is_pad"])[:, :, None] & batch["action_dim_mask"][:, None, :]).float()


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def time_kwargs(cfg: PolicyConfig) -> dict:
    return dict(kind=cfg.time_sampling, alpha=cfg.time_beta_alpha, beta=cfg.time_beta_beta, scale=cfg.time_scale, offset=cfg.time_offset)


def step_noise(cfg: TrainConfig, step: int, rank: int, world: int, device: torch.device):
    """This rank's rows of global batch ``step``'s noise and times."""
    p = cfg.policy
    noise, t = draw_noise_and_time(cfg.seed, step, (cfg.batch_size, p.chunk_size, p.max_action_dim), **time_kwargs(p))
    per = cfg.batch_size // world
    rows = slice(rank * per, (rank + 1) * per)
    return noise[rows].to(device), t[rows].to(device)


def distributed_loss(model, batch, noise, t, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss to backpropagate, global mean loss)``: masked sum over this rank's elements divided by
    the global valid count, times ``world`` (DDP/FSDP average gradients over ranks)."""
    per_element = model(batch, noise, t)
    mask = loss_mask(batch)
    local = (per_element * mask).sum()
    totals = all_reduce_sum(torch.stack([local.detach(), mask.sum()]))
    count = totals[1].clamp_min(1.0)
    return local * world / count, totals[0] / count


def load_pretrained(policy, cfg: PolicyConfig) -> None:
    if cfg.pretrained is None:
        return
    path = Path(cfg.pretrained)
    if not path.is_file():
        raise FileNotFoundError(f"policy.pretrained={str(path)!r}: no such file")
    sd = load_file(str(path))
    if cfg.pretrained_format == "lerobot":
        if cfg.name != "pi05":
            raise ValueError(f"policy.pretrained_format=lerobot: only the pi05 layout is mapped, not {cfg.name!r}")
        sd = from_lerobot_pi05(sd)
    missing, unexpected = policy.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise KeyError(f"policy.pretrained={str(path)!r}: missing {missing[:5]}..., unexpected {unexpected[:5]}... "
                       f"({len(missing)} missing, {len(unexpected)} unexpected)")


def checkpoint_manifest(cfg: TrainConfig, policy, dataset: EmbodiedDataset, step: int, mode: str, world: int) -> dict:
    return {
        "family": policy.family,
        "config": to_dict(cfg),
        "dataset": {**asdict(dataset.spec), "root": str(dataset.meta.root)},
        "consumed_samples": step * cfg.batch_size,
        "layout": {"mode": mode, "world_size": world, "dp_replicate": cfg.parallel.dp_replicate},
    }


def check_resume_config(saved: dict, cfg: TrainConfig, where: Path) -> None:
    now = to_dict(cfg)
    for group in ("policy", "dataset"):
        diff = sorted(k for k in set(saved[group]) | set(now[group]) if saved[group].get(k) != now[group].get(k)
                      and k not in ("root", "num_workers", "pretrained", "pretrained_format"))
        if diff:
            raise ValueError(f"cannot resume from {where}: {group} config differs in {', '.join(f'{group}.{k}' for k in diff)}")
    if saved["batch_size"] != cfg.batch_size or saved["seed"] != cfg.seed:
        raise ValueError(f"cannot resume from {where}: batch_size/seed differ from the checkpoint's")


def train(cfg: TrainConfig) -> TrainResult:
    env = init_distributed(group_for_world_of_one=False)
    mode = resolve_mode(cfg.parallel, env.world_size)
    root = resolve_dataset_root(cfg.dataset, env)
    dataset = EmbodiedDataset(cfg.dataset, cfg.policy, root, "train")
    env.accelerator.manual_seed(cfg.seed)
    policy = build_policy(cfg.policy)
    load_pretrained(policy, cfg.policy)
    policy.to(env.device)
    model = parallelize(policy, cfg.parallel, env)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)

    run_dir = Path(cfg.run_dir)
    start = 0
    resume_from = find_resume_checkpoint(run_dir) if cfg.resume else None
    if resume_from is not None:
        ckpt = Checkpoint(resume_from)
        check_resume_config(ckpt.manifest["config"], cfg, resume_from)
        load_training_state(ckpt, model, optimizer)
        start = ckpt.step
    sampler = StepBatchSampler(len(dataset), cfg.batch_size, env.rank, env.world_size, cfg.seed, start_step=start)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.dataset.num_workers,
                        pin_memory=env.device.type != "cpu")
    logger = MetricsLogger(run_dir, enabled=env.is_main, tensorboard=cfg.tensorboard)
    bar = progress(cfg.steps, f"train {policy.family}", enabled=env.is_main and cfg.progress, initial=start)
    losses: list[float] = []
    step, it = start, iter(loader)
    tick, window, window_loss = time.perf_counter(), 0, 0.0
    model.train()
    try:
        while step < cfg.steps:
            batch = to_device(next(it), env.device)
            noise, t = step_noise(cfg, step, env.rank, env.world_size, env.device)
            lr = lr_at(step, cfg.steps, o)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with compute_precision(cfg.parallel, env.world_size, env.device):
                loss, mean_loss = distributed_loss(model, batch, noise, t, env.world_size)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window += 1
            losses.append(float(mean_loss))
            window_loss += losses[-1]
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if step % cfg.log_every == 0 or step == cfg.steps:
                env.accelerator.synchronize()
                elapsed = time.perf_counter() - tick
                logger.log(step, {"loss": losses[-1], "grad_norm": float(grad_norm), "lr": lr,
                                  "samples_per_s": window * cfg.batch_size / max(elapsed, 1e-9)})
                tick, window, window_loss = time.perf_counter(), 0, 0.0
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
                save_training_state(run_dir, step, model, optimizer,
                                    checkpoint_manifest(cfg, unwrap(model), dataset, step, mode, env.world_size),
                                    is_main=env.is_main, keep_last=cfg.keep_last)
    finally:
        bar.close()
        logger.close()
    return TrainResult(run_dir, start, step, losses)
