"""The diffusion training loop (PyTorch-native DDP/FSDP2 + Ulysses CP).

Per step: the step's global samples are planned over DP ranks by compute cost (core balancer);
each rank packs its samples (mixed sizes in one sequence, split further into micro-batches by
``data.max_tokens_per_pack``), adds noise online (per sample, seeded by (seed, step, position),
so the result does not depend on the layout), and regresses the flow-matching velocity. The loss
is normalised over the whole global batch, so any DP/CP/micro-batch split gives the same loss and
gradients. Wan 2.2 trains one expert per step. Then AdamW (fused on CUDA) with warmup + cosine
LR, gradient clipping, EMA, metrics, checkpoints. On CUDA the transformer blocks are compiled
(``model.compile``).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge.core.accelerators import get_accelerator
from loongforge.core.config import to_dict
from loongforge.core.metrics import MetricsLogger, progress
from loongforge.core.parallel import init_parallel
from loongforge.diffusion import checkpointing
from loongforge.diffusion.context_parallel import ContextParallel
from loongforge.diffusion.data.batching import generator, plan, step_samples
from loongforge.diffusion.data.shards import LatentShards
from loongforge.diffusion.ema import EMA
from loongforge.diffusion.model import EXPERT_NAMES, WanExperts
from loongforge.diffusion.model.convert import load_pretrained
from loongforge.diffusion.model.flops import cost_model, training_flops
from loongforge.diffusion.objective import (
    TimestepSampler,
    noisy_and_target,
    pick_expert,
    token_weights,
    weighted_squared_error,
)
from loongforge.diffusion.packing import num_tokens, pack, pack_targets, pad_text
from loongforge.diffusion.parallelize import accumulation, autocast, gradient_sync, wrap
from loongforge.diffusion.schema import DiffusionRecipe

FAMILY = "wan"


def resolve_data_root(recipe: DiffusionRecipe, is_main: bool) -> Path:
    if recipe.data.root:
        return Path(recipe.data.root).expanduser()
    from loongforge.diffusion.data.synthetic import builtin_dataset, cache_root

    if is_main:
        builtin_dataset(recipe.data.synthetic_clips, show_progress=recipe.log.progress)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return cache_root() / f"n{recipe.data.synthetic_clips}" / "latents"


def lr_at(step: int, cfg) -> float:
    """LR of (0-based) ``step``: linear warmup, then cosine/linear decay to min_lr at train.steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    span = max(cfg.steps - cfg.warmup_steps, 1)
    frac = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    factor = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_decay_style == "cosine" else 1 - frac
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


class DiffusionTrainer:
    def __init__(self, recipe: DiffusionRecipe):
        self.recipe = recipe
        r, m = recipe, recipe.model
        m.check_device(get_accelerator().device_type)
        self.ctx = ctx = init_parallel(cp=r.parallel.cp, seed=r.train.seed)
        self.device = ctx.device
        self.cp = ContextParallel.from_group(ctx.pgs.cp)
        self.cp_size = r.parallel.cp
        self.dp_rank, self.dp_size = ctx.pgs.dp.rank(), ctx.dp_size
        self.grad_group = ctx.pgs.dp_cp
        self.grad_world = dist.get_world_size(self.grad_group)
        if r.train.global_batch_size < self.dp_size:
            raise ValueError(f"train.global_batch_size={r.train.global_batch_size} is smaller than the DP size {self.dp_size}")
        if r.train.precision == "auto":
            self.dtype = torch.bfloat16 if self.device.type != "cpu" else torch.float32
        else:
            self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[r.train.precision]

        self.data_root = resolve_data_root(r, ctx.is_main)
        self.dataset = LatentShards(self.data_root)
        facts = self.dataset.manifest
        for key, field in (("latent_channels", "in_channels"), ("text_dim", "text_dim")):
            if facts.get(key) is not None and facts[key] != getattr(m, field):
                raise ValueError(f"{self.data_root}/manifest.json: {key}={facts[key]} but model.{field}={getattr(m, field)}")
        longest = max(rec["text_tokens"] for rec in self.dataset.records)
        if longest > m.text_len:
            raise ValueError(f"{self.data_root}/manifest.json: prompts of up to {longest} tokens but model.text_len={m.text_len}")
        self.tokens = [num_tokens(self.dataset.latent_shape(i), m.patch_size) for i in range(len(self.dataset))]

        self.trainable_names = (list(EXPERT_NAMES[: 2 if m.boundary_ratio is not None else 1])
                                if r.train.expert == "all" else [r.train.expert])
        # pretrained weights under FSDP2: build on the meta device, shard, then each rank reads
        # only its rows; otherwise build on the host (same seed, so the same init on every rank)
        sharded_init = bool(m.pretrained) and r.train.data_parallel == "fsdp2" and self.grad_world > 1
        torch.manual_seed(r.train.seed)
        with torch.device("meta") if sharded_init else contextlib.nullcontext():
            self.model = WanExperts(m)
        if m.pretrained and not sharded_init:
            load_pretrained(self.model, m.pretrained)
        if not sharded_init:
            self.model.to(self.device)
        self.experts_by_name = {n: self.model.expert(n) for n in self.model.names}
        if m.compile_on(self.device.type, self.cp_size):
            for expert in self.experts_by_name.values():
                expert.compile_regions(dynamic=None)  # packs change length: one recompile makes it generic
        self.wrapped = {}
        for name, expert in self.experts_by_name.items():
            if name not in self.trainable_names:
                expert.requires_grad_(False)
            self.wrapped[name] = wrap(expert, r.train.data_parallel, self.grad_group, self.device.type, self.dtype)
        if sharded_init:
            self.model.to_empty(device=self.device)
            load_pretrained(self.model, m.pretrained)
        self.named_trainable = {f"{n}.{k}": p for n in self.trainable_names for k, p in self.model.expert(n).named_parameters()}
        self.optimizer = torch.optim.AdamW(
            list(self.named_trainable.values()), lr=r.train.lr, betas=(r.train.adam_beta1, r.train.adam_beta2),
            eps=r.train.adam_eps, weight_decay=r.train.weight_decay, fused=self.device.type == "cuda",
        )
        self.ema = EMA(self.named_trainable, r.ema.decay) if r.ema.decay > 0 else None
        self.sampler = TimestepSampler(r.objective)
        boundary = self.model.boundary_timestep(r.objective.num_train_timesteps)
        self.ranges = {n: self.sampler.index_range(boundary, EXPERT_NAMES.index(n)) for n in self.model.names}
        self.cost_model = cost_model(m)
        self.step = 0
        self.run_dir = Path(r.log.run_dir)
        self.ckpt_dir = Path(r.checkpoint.dir) if r.checkpoint.dir else self.run_dir / "checkpoints"
        self.features = m.out_channels * m.patch_volume
        self._peak = ctx.accelerator.peak_flops(self.dtype)

    # -- bookkeeping ------------------------------------------------------------------------
    def manifest_fields(self) -> dict:
        r = self.recipe
        return {
            "family": FAMILY,
            "config": to_dict(r),
            "layout": {"dp": self.dp_size, "cp": self.cp_size, "data_parallel": r.train.data_parallel},
            "consumed_samples": self.step * r.train.global_batch_size,
            "data_root": str(self.data_root.resolve()),
            "experts": self.model.names,
            "ema": self.ema is not None,
        }

    def choose_expert(self, step: int) -> str:
        """The expert trained at ``step`` (the same on every rank)."""
        r = self.recipe
        if len(self.model.names) == 1:
            return self.model.names[0]
        if r.train.expert != "all":
            return r.train.expert
        return pick_expert(self.sampler, self.ranges, generator(r.train.seed, step, -1))

    # -- one step ---------------------------------------------------------------------------
    def micro_batch(self, step: int, positions: list[int], indices: list[int], index_range):
        """Noisy packed inputs, targets and loss weights of some of the step's samples."""
        r, m = self.recipe, self.recipe.model
        latents, texts, targets, timesteps = [], [], [], []
        for j in positions:
            x0, text = self.dataset.load(indices[j])
            g = generator(r.train.seed, step, j)
            sigma, t = self.sampler.sample(1, g, index_range)
            noise = torch.randn(x0.shape, generator=g)
            if r.objective.text_dropout and torch.rand(1, generator=g).item() < r.objective.text_dropout:
                text = torch.zeros_like(text)
            xt, target = noisy_and_target(x0, noise, sigma.item())
            latents.append(xt)
            targets.append(target)
            texts.append(text)
            timesteps.append(t)
        batch = pack(latents, torch.cat(timesteps), pad_text(texts, m.text_len), m.patch_size, pad_to_multiple=self.cp_size)
        target = pack_targets(targets, m.patch_size, batch.num_pad)
        return batch, target

    def micro_step(self, model, step, positions, indices, index_range, tokens, global_elements, sync) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its (detached) share of the loss."""
        r = self.recipe
        batch, target = self.micro_batch(step, positions, indices, index_range)
        weights = token_weights([tokens[j] for j in positions], batch.num_pad, r.objective.loss_reduction,
                                global_elements, float(len(indices)), self.features)
        lo, hi = self.cp.local_range(batch.num_tokens) if self.cp else (0, batch.num_tokens)
        batch = batch.to(self.device)
        with gradient_sync(model, sync):
            with autocast(model, self.device.type, self.dtype):
                pred = model(batch, self.cp)
            loss = weighted_squared_error(pred, target[lo:hi].to(self.device), weights[lo:hi].to(self.device))
            # gradients are averaged over the grad group; the loss is already a share of the global sum
            (loss * self.grad_world).backward()
        return loss.detach().double()

    def train_step(self) -> dict[str, float]:
        r = self.recipe
        step = self.step
        t0 = time.perf_counter()
        expert = self.choose_expert(step)
        model = self.wrapped[expert]
        index_range = self.ranges[expert]
        indices = step_samples(step, r.train.global_batch_size, len(self.dataset), r.train.seed)
        tokens = [self.tokens[i] for i in indices]
        step_plan = plan(tokens, self.cost_model, self.dp_size, r.data.max_tokens_per_pack or None, r.train.balance)
        micro = step_plan.micro_batches(self.dp_rank)
        global_elements = float(sum(tokens) * self.features)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, r.train)
        local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        uneven = len(set(step_plan.micro_counts.tolist())) > 1
        with accumulation(model, uneven):
            for k, positions in enumerate(micro):
                local_sum += self.micro_step(model, step, positions, indices, index_range, tokens, global_elements,
                                             sync=k == len(micro) - 1)
        params = [p for n, p in self.named_trainable.items() if n.startswith(expert + ".")]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, r.train.clip_grad if r.train.clip_grad > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.ema is not None and self.step % r.ema.update_interval == 0:
            self.ema.update()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(local_sum, group=self.grad_group)
        self.ctx.accelerator.synchronize()
        seconds = time.perf_counter() - t0
        out = {
            "loss": float(local_sum),
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "expert": float(EXPERT_NAMES.index(expert)),
            "tokens": float(sum(tokens)),
            "tokens_per_s": sum(tokens) / seconds,
            "samples_per_s": len(indices) / seconds,
            "step_time_s": seconds,
            "micro_batches": float(len(micro)),
            **step_plan.metrics.as_dict(),
        }
        if self._peak:
            out["mfu"] = training_flops(self.recipe.model, tokens) / seconds / (self._peak * self.ctx.world_size)
        return out

    # -- the loop ---------------------------------------------------------------------------
    def save(self) -> None:
        checkpointing.save(self, self.ckpt_dir)

    def fit(self) -> list[dict]:
        from loongforge.core.checkpoint import latest_checkpoint
        from loongforge.core.checkpoint.format import Checkpoint

        r = self.recipe
        if r.checkpoint.resume and latest_checkpoint(self.ckpt_dir) is not None:
            checkpointing.load(self, self.ckpt_dir)
        elif r.checkpoint.load:
            checkpointing.load_model(self.experts_by_name, Checkpoint(r.checkpoint.load))
        end = r.train.steps if not r.train.exit_interval else min(r.train.steps, self.step + r.train.exit_interval)
        logger = MetricsLogger(self.run_dir, enabled=self.ctx.is_main, tensorboard=r.log.tensorboard)
        bar = progress(r.train.steps, "train", enabled=self.ctx.is_main and r.log.progress, initial=self.step)
        history = []
        try:
            while self.step < end:
                metrics = self.train_step()
                history.append({"step": self.step, **metrics})
                if self.step % r.log.interval == 0 or self.step == end:
                    logger.log(self.step, metrics)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")
                interval = r.checkpoint.interval
                if r.checkpoint.save and ((interval and self.step % interval == 0) or self.step == end):
                    self.save()
        finally:
            bar.close()
            logger.close()
        return history
