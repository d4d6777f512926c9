"""The shared training loop on megatron-core.

One loop for every megatron-based modality: megatron's ``get_forward_backward_func`` schedules
(pipeline parallel with micro-batches), megatron DDP or the distributed optimizer, AdamW,
warmup + cosine LR (megatron's ``OptimizerParamScheduler``), grad clipping, per-token loss
normalisation (so any DP/micro-batch split of a global batch gives the same loss and gradients),
a number of micro-batches that may vary per step and per DP rank (a task that plans its own, e.g.
with the DP load balancer: megatron's ``forward_backward_func`` takes the count per call, and the
per-token normalisation sums the token counts over DP, so the result stays exact), and logging
of loss, grad norm, LR, tokens/s, MFU and the task's step metrics to the console (progress bar),
``RUN_DIR/metrics.jsonl`` and TensorBoard. Checkpoints use the core format (``checkpoint``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from loongforge.core.metrics import MetricsLogger, progress
from loongforge.core.parallel import ParallelContext
from loongforge.core.training.schema import CheckpointConfig, LogConfig, TrainConfig
from loongforge.core.training.task import MegatronTask, StepBatch


def use_fused_adam(optimizer, device: torch.device) -> None:
    """Without Transformer Engine or apex, megatron-core steps with ``torch.optim.AdamW`` in its
    multi-tensor (``foreach``) form: about ten passes over the fp32 weights, grads and moments. On
    CUDA, switch its param groups to torch's fused AdamW (the same update in one kernel) before
    the first step creates any state."""
    if device.type != "cuda":
        return
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if isinstance(adam, torch.optim.Adam | torch.optim.AdamW) and not adam.state:
            for group in adam.param_groups:
                group["foreach"], group["fused"] = False, True


def resolve_dtype(precision: str, ctx: ParallelContext) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if ctx.device.type != "cpu" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)
    compute_seconds: float = float("nan")  # this rank's forward+backward, up to the gradient reduction


class MegatronTrainer:
    def __init__(
        self,
        task: MegatronTask,
        ctx: ParallelContext,
        train: TrainConfig,
        log: LogConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        config_record: dict | None = None,
    ):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        self.task, self.ctx, self.train = task, ctx, train
        self.log_cfg = log or LogConfig()
        self.ckpt_cfg = checkpoint or CheckpointConfig(save=False)
        self.config_record = config_record or {}
        dp = ctx.dp_size
        self.variable_micro_batches = bool(getattr(task, "variable_micro_batches", False))
        if self.variable_micro_batches:
            self.num_microbatches = None  # the task plans each step's micro-batches
            if train.global_batch_size < dp:
                raise ValueError(f"train.global_batch_size={train.global_batch_size} must be >= the DP size {dp}")
        else:
            if train.global_batch_size % (train.micro_batch_size * dp):
                raise ValueError(
                    f"train.global_batch_size={train.global_batch_size} must be a multiple of "
                    f"micro_batch_size*dp = {train.micro_batch_size}*{dp}"
                )
            self.num_microbatches = train.global_batch_size // (train.micro_batch_size * dp)
        self.dtype = resolve_dtype(train.precision, ctx)
        bf16 = self.dtype == torch.bfloat16
        recompute = {}
        if train.recompute == "full":
            recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif train.recompute == "selective":
            recompute = dict(recompute_granularity="selective")
        self.transformer_config = TransformerConfig(
            **task.transformer_config_kwargs(),
            tensor_model_parallel_size=ctx.layout.tp,
            pipeline_model_parallel_size=ctx.layout.pp,
            context_parallel_size=ctx.layout.cp,
            expert_model_parallel_size=ctx.layout.ep,
            sequence_parallel=False,
            use_cpu_initialization=True,
            perform_initialization=True,
            params_dtype=self.dtype,
            pipeline_dtype=self.dtype,
            bf16=bf16,
            calculate_per_token_loss=True,
            **recompute,
        )
        from loongforge.core.training import checkpointing

        self.run_dir = Path(self.log_cfg.run_dir)
        self.ckpt_dir = Path(self.ckpt_cfg.dir) if self.ckpt_cfg.dir else self.run_dir / "checkpoints"
        self.resuming = bool(self.ckpt_cfg.resume) and checkpointing.has_checkpoint(self.ckpt_dir)
        module = task.build_model(ctx, self.transformer_config, ctx.is_first_stage, ctx.is_last_stage,
                                  load_initial_weights=not self.resuming)
        module.to(ctx.device)
        if bf16:
            module = Float16Module(self.transformer_config, module)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=train.overlap_grad_reduce,
            use_distributed_optimizer=train.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(self.transformer_config, ddp_config, module, pg_collection=ctx.pgs)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=train.lr,
                min_lr=train.min_lr,
                weight_decay=train.weight_decay,
                adam_beta1=train.adam_beta1,
                adam_beta2=train.adam_beta2,
                adam_eps=train.adam_eps,
                clip_grad=train.clip_grad,
                bf16=bf16,
                params_dtype=self.dtype,
                use_distributed_optimizer=train.use_distributed_optimizer,
            ),
            [self.model],
            use_gloo_process_groups=False,
            pg_collection=ctx.pgs,
        )
        use_fused_adam(self.optimizer, ctx.device)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if train.warmup_steps else train.lr,
            max_lr=train.lr,
            min_lr=train.min_lr if train.lr_decay_style != "constant" else train.lr,
            lr_warmup_steps=train.warmup_steps * train.global_batch_size,
            lr_decay_steps=max(train.steps, 1) * train.global_batch_size,
            lr_decay_style=train.lr_decay_style,
            start_wd=train.weight_decay,
            end_wd=train.weight_decay,
            wd_incr_steps=max(train.steps, 1) * train.global_batch_size,
            wd_incr_style="constant",
        )
        cfg = self.transformer_config
        self._finalize_model_grads = finalize_model_grads
        cfg.finalize_model_grads_func = self._finalize_grads_timed
        self._compute_end = None
        cfg.no_sync_func = self.model.no_sync
        if train.overlap_grad_reduce:
            cfg.grad_sync_func = self.model.start_grad_sync
        self.step = 0
        self.consumed_samples = 0
        self.data = None  # the task's step iterator (made in fit)
        self.resumed_data_state = None  # its state from the checkpoint resumed from, if any
        self._flops_per_token = task.flops_per_token(train.seq_length)
        peak = ctx.accelerator.peak_flops(self.dtype)
        self._peak_total = peak * ctx.world_size if peak else None

    # -- one step ---------------------------------------------------------------------------
    def _finalize_grads_timed(self, *args, **kwargs):
        """megatron's ``finalize_model_grads`` (gradient reduction over DP), timed at its start:
        the rank's own compute ends there, before it waits for the slowest rank."""
        if self.data is not None and getattr(self.data, "measuring", False):
            self.ctx.accelerator.synchronize()
        self._compute_end = time.perf_counter()
        return self._finalize_model_grads(*args, **kwargs)

    @property
    def inner_model(self) -> torch.nn.Module:
        """The task's model inside megatron's DDP (and Float16Module) wrappers."""
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model)

    def train_step(self, step: StepBatch | list[dict[str, torch.Tensor]]) -> StepResult:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not isinstance(step, StepBatch):
            step = StepBatch(micro_batches=list(step))
        micro_batches = step.micro_batches
        if self.num_microbatches is not None and len(micro_batches) != self.num_microbatches:
            raise ValueError(f"expected {self.num_microbatches} micro-batches, got {len(micro_batches)}")
        if not micro_batches:
            raise ValueError(f"step {self.step + 1}: DP rank {self.ctx.dp_rank} got no micro-batch")
        t0 = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        forward_backward = get_forward_backward_func(pp_size=self.ctx.layout.pp)
        losses = forward_backward(
            forward_step_func=self.task.forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=self.train.seq_length,
            micro_batch_size=self.train.micro_batch_size,
            forward_only=False,
        )
        compute_seconds = (self._compute_end - t0) if self._compute_end is not None else float("nan")
        self._compute_end = None
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=self.train.global_batch_size)
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # loss sum, loss tokens, input tokens
        if self.ctx.is_last_stage:
            for entry in losses:
                loss_sum, num_tokens = entry["lm loss"]
                totals[0] += loss_sum.detach().double()
                totals[1] += float(num_tokens)
            if step.tokens is not None and self.ctx.pgs.cp.rank() == 0:
                totals[2] = float(step.tokens)  # one count per DP replica
        if self.ctx.is_last_stage and self.ctx.tp_rank != 0:
            totals.zero_()  # TP ranks hold the same loss; count it once
        dist.all_reduce(totals)
        self.ctx.accelerator.synchronize()
        seconds = time.perf_counter() - t0
        self.step += 1
        self.consumed_samples += self.train.global_batch_size
        tokens = int(totals[2].item()) if step.tokens is not None else self.train.global_batch_size * self.train.seq_length
        return StepResult(
            step=self.step,
            loss=(totals[0] / totals[1].clamp(min=1)).item(),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            tokens=tokens,
            seconds=seconds,
            extra=dict(step.metrics),
            compute_seconds=compute_seconds,
        )

    def metrics(self, result: StepResult) -> dict[str, float]:
        tps = result.tokens / result.seconds
        out = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr, "tokens_per_s": tps,
               "step_time_s": result.seconds, "consumed_samples": self.consumed_samples}
        if self._peak_total:
            out["mfu"] = tps * self._flops_per_token / self._peak_total
        out.update(result.extra)
        return out

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> list[StepResult]:
        from loongforge.core.training import checkpointing

        if self.resuming:
            checkpointing.load(self, self.ckpt_dir)
        elif self.ckpt_cfg.load:
            checkpointing.load_weights(self, self.ckpt_cfg.load)
        results: list[StepResult] = []
        self.data = self.task.micro_batches(self.ctx, self.consumed_samples)
        if self.resumed_data_state is not None and hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(self.resumed_data_state)
        logger = MetricsLogger(self.run_dir, enabled=self.ctx.is_main, tensorboard=self.log_cfg.tensorboard)
        samples_log = self._open_sample_log()
        bar = progress(self.train.steps, "train", enabled=self.ctx.is_main and self.log_cfg.progress, initial=self.step)
        try:
            while self.step < self.train.steps:
                batch = next(self.data)
                result = self.train_step(batch)
                results.append(result)
                if hasattr(self.data, "record_compute_seconds"):
                    self.data.record_compute_seconds(result.compute_seconds)
                if samples_log is not None and isinstance(batch, StepBatch):
                    samples_log.write(json.dumps({"step": self.step, "dp_rank": self.ctx.dp_rank,
                                                  "ids": [int(i) for i in batch.sample_ids]}) + "\n")
                metrics = self.metrics(result)
                if self.step % self.log_cfg.interval == 0 or self.step == self.train.steps:
                    logger.log(self.step, metrics)
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                interval = self.ckpt_cfg.interval
                if self.ckpt_cfg.save and ((interval and self.step % interval == 0) or self.step == self.train.steps):
                    checkpointing.save(self, self.ckpt_dir)
        finally:
            bar.close()
            logger.close()
            if samples_log is not None:
                samples_log.close()
        return results

    def _open_sample_log(self):
        """``RUN_DIR/sample_ids/dp_rank_<r>.jsonl`` (appended), written by the first rank of each DP replica."""
        if not self.log_cfg.sample_ids:
            return None
        ctx = self.ctx
        if ctx.tp_rank != 0 or ctx.pp_rank != 0 or ctx.pgs.cp.rank() != 0:
            return None
        directory = self.run_dir / "sample_ids"
        directory.mkdir(parents=True, exist_ok=True)
        return open(directory / f"dp_rank_{ctx.dp_rank}.jsonl", "a", buffering=1)

    def data_state_dict(self) -> dict | None:
        """The step iterator's state for the checkpoint (None when it keeps none)."""
        return self.data.state_dict() if self.data is not None and hasattr(self.data, "state_dict") else None
