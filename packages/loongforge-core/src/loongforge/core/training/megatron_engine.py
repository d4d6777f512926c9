"""The megatron-core engine: megatron's ``get_forward_backward_func`` schedules (pipeline
parallel with micro-batches), megatron DDP or the distributed optimizer, AdamW (fused on CUDA),
grad clipping, and per-token loss normalisation (``calculate_per_token_loss``: any DP /
micro-batch split of a global batch gives the same loss and gradients; the number of
micro-batches may vary per step and per DP rank, since megatron's ``forward_backward_func`` takes
the count per call and the per-token normalisation sums the counts over DP). The gradients
``forward_backward`` leaves are sums over the step's loss tokens; the division by their count
(the step's loss tokens) happens in the norm and inside the optimizer step, with the clipping
factor, not as a pass of its own over every gradient. A task's
``before_schedule`` hook (``loongforge.core.training.task.ScheduledStep``) runs before the schedule
and its ``after_schedule`` after the schedule's last backward, before the gradient reduction.
Under ChunkPipe (``train.seq_chunks > 1``, ``chunk_pipe``) every pipeline stage runs megatron's
schedule without pipelining: the chunks of each micro-batch fill the pipeline instead of the
micro-batches.

The LR comes from the loop (``train_step(step, lr)``); megatron's own scheduler is not used. The
weight decay of each param group is ``train.weight_decay`` times the group's ``wd_mult``
(megatron leaves biases and norms undecayed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongforge.core.kernels import get_op
from loongforge.core.parallel import ParallelContext
from loongforge.core.training.activation_offload import offload_first
from loongforge.core.training import grad_update
from loongforge.core.training.engine import (EngineState, StepOutput, finite, precision_recipe, read_step_output,
                                             resolve_dtype)
from loongforge.core.training.main_grad import main_grad_fusion
from loongforge.core.training.schema import ParallelConfig, SequenceTrainConfig, TrainConfig
from loongforge.core.training.task import MegatronTask, StepBatch


@dataclass
class _StepSums:
    """A step's numbers on the device: the per-token mean loss and gradient norm, the loss tokens
    (the gradients' divisor), the summed totals (loss sum, count, input tokens, FLOPs; in a single
    process the input tokens and FLOPs stay on the host: ``host_totals``)."""

    loss: torch.Tensor
    norm: torch.Tensor
    divisor: torch.Tensor
    totals: torch.Tensor
    host_totals: list[float] | None
    compute_seconds: float
    offloaded: int | None


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


def recompute_kwargs(recompute: str) -> dict:
    """megatron's ``TransformerConfig`` activation-recompute fields for ``none | selective | full``."""
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective")
    if recompute != "none":
        raise ValueError(f"recompute={recompute!r}: one of none, selective, full")
    return {}


def fresh_moe_metrics() -> None:
    """A new megatron MoE metrics tracker for this engine's model: megatron keeps one per process,
    sized by the first MoE model that records into it, so a second model with more layers in the
    same process (a proxy of ``lf-llm info``, a test) would index past its end."""
    from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker, set_moe_metrics_tracker

    set_moe_metrics_tracker(MoEMetricsTracker())


def transformer_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """megatron-core's transformer layers of a model (or pipeline stage), in forward order: the
    repeated blocks ``train.offload_layers`` counts (a VLM's encoder layers come first)."""
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    return [m for m in module.modules() if isinstance(m, BaseTransformerLayer)]


def check_parallel_config(parallel: ParallelConfig) -> None:
    """What the megatron-core engine cannot do, as a config error (before any process group)."""
    if parallel.data_parallel not in ("auto", "ddp"):
        raise ValueError(f"parallel.data_parallel={parallel.data_parallel!r}: the megatron-core engine keeps "
                         f"replicas with megatron DDP (auto/ddp); shard optimizer state with "
                         f"train.use_distributed_optimizer=true")


def check_train_config(train: TrainConfig) -> None:
    if train.compile:
        raise ValueError("train.compile=true: the megatron-core engine does not torch.compile the model; leave it null")
    if train.precision == "bf16-pure" and train.use_distributed_optimizer:
        raise ValueError("train.precision=bf16-pure with train.use_distributed_optimizer=true: megatron's distributed "
                         "optimizer keeps fp32 main weights of its shard; train in bf16 (mixed precision) or with "
                         "the standard optimizer")


class MegatronEngine:
    name = "megatron"

    def __init__(self, task: MegatronTask, ctx: ParallelContext, train: TrainConfig, parallel: ParallelConfig,
                 resuming: bool = False):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        check_parallel_config(parallel)
        check_train_config(train)
        self.task, self.ctx, self.train = task, ctx, train
        if isinstance(train, SequenceTrainConfig):  # token models (LLM, VLM); ChunkPipe: seq_chunks > 1
            self.seq_length, self.seq_chunks = train.seq_length, train.seq_chunks
        else:
            self.seq_length, self.seq_chunks = 1, 1
        dp = ctx.dp_size
        self.variable_micro_batches = task.variable_micro_batches
        if self.variable_micro_batches:
            self.num_microbatches = None  # the task plans each step's micro-batches
            self.micro_batch_size = 1
            if train.global_batch_size < dp:
                raise ValueError(f"train.global_batch_size={train.global_batch_size} must be >= the DP size {dp}")
        else:
            self.micro_batch_size = train.micro_batch_size or train.global_batch_size // dp
            if train.global_batch_size % (self.micro_batch_size * dp):
                raise ValueError(f"train.global_batch_size={train.global_batch_size} must be a multiple of "
                                 f"micro_batch_size*dp = {self.micro_batch_size}*{dp}")
            self.num_microbatches = train.global_batch_size // (self.micro_batch_size * dp)
        self.dtype = resolve_dtype(train.precision, ctx.device)
        self.precision = precision_recipe(train.precision, ctx.device)  # mixed | pure | fp32
        bf16 = self.dtype == torch.bfloat16
        pure = self.precision == "pure"
        if task.transformer_config_kwargs().get("overlap_moe_expert_parallel_comm") and not bf16:
            from loongforge.core.config import ConfigError

            raise ConfigError(f"model.moe_a2a_overlap=true: train.precision={train.precision} runs in {self.dtype} "
                              f"here; megatron overlaps the MoE all-to-all in bf16 (train.precision=bf16)")
        self.transformer_config = TransformerConfig(
            **recompute_kwargs(train.recompute),
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
        )
        fresh_moe_metrics()
        module = task.build_model(ctx, self.transformer_config, ctx.is_first_stage, ctx.is_last_stage,
                                  load_initial_weights=not resuming)
        module.to(ctx.device)
        self.offload = offload_first(transformer_layers(module), train.offload_layers, ctx.device)
        if bf16:
            module = Float16Module(self.transformer_config, module)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=not pure,  # pure bf16: the gradient buffer (main_grad) in bf16
            overlap_grad_reduce=train.overlap_grad_reduce,
            use_distributed_optimizer=train.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(self.transformer_config, ddp_config, module, pg_collection=ctx.pgs)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=train.lr,
                min_lr=train.final_lr,
                weight_decay=train.weight_decay,
                adam_beta1=train.adam_beta1,
                adam_beta2=train.adam_beta2,
                adam_eps=train.adam_eps,
                clip_grad=train.clip_grad,
                bf16=bf16 and not pure,  # pure bf16: megatron's FP32Optimizer, stepping the bf16 params themselves
                params_dtype=self.dtype,
                use_distributed_optimizer=train.use_distributed_optimizer,
            ),
            [self.model],
            use_gloo_process_groups=False,
            pg_collection=ctx.pgs,
        )
        use_fused_adam(self.optimizer, ctx.device)
        # train.optimizer_kernel=loongforge: the update through the registry's fused adamw_step (CUDA, the
        # standard optimizer, loongforge-kernels installed); otherwise torch's fused AdamW
        self._adamw_step = ctx.kernels.get("adamw_step")
        self._own_adamw = (train.optimizer_kernel == "loongforge" and ctx.device.type == "cuda"
                           and grad_update.adamw_applies(self.optimizer)
                           and self._adamw_step is not get_op("adamw_step").reference)
        self._adamw_plans: dict = {}  # adamw_step's launch tables, kept between steps
        self.set_group_hyperparameters()
        cfg = self.transformer_config
        self._finalize_model_grads = finalize_model_grads
        cfg.finalize_model_grads_func = self._finalize_grads_timed
        self._compute_end = None
        # the step's ScheduledStep.after_schedule, run before the grad reduction
        self._after_schedule: Callable[[], None] | None = None
        self._measuring = False
        cfg.no_sync_func = self.model.no_sync
        if train.overlap_grad_reduce:
            cfg.grad_sync_func = self.model.start_grad_sync

    def set_group_hyperparameters(self) -> None:
        """AdamW's settings of every param group from ``train`` (weight decay times the group's
        ``wd_mult``, betas, epsilon); again after a resume has loaded the saved groups, so the
        config's values hold, as on the PyTorch-native engine. The LR is set at every step."""
        train = self.train
        for group in self.optimizer.param_groups:
            group["weight_decay"] = train.weight_decay * group.get("wd_mult", 1.0)
            group["betas"] = (train.adam_beta1, train.adam_beta2)
            group["eps"] = train.adam_eps

    # -- one step ---------------------------------------------------------------------------
    def _finalize_grads_timed(self, model, num_tokens=None, **kwargs):
        """megatron's ``finalize_model_grads`` (gradient reduction over DP, the shared and
        sequence-parallel gradients), after the step's ``after_schedule`` (if any), timed at its
        start: the rank's own compute ends there, before it waits for the slowest rank. The
        per-token normalisation (``num_tokens``) is left out here: the update divides by the
        step's loss tokens inside the optimizer step instead of a pass over every gradient."""
        if self._after_schedule is not None:
            after, self._after_schedule = self._after_schedule, None
            after()
        if self._measuring:
            self.ctx.accelerator.synchronize()
        self._compute_end = time.perf_counter()
        return self._finalize_model_grads(model, None, **kwargs)

    @property
    def inner_model(self) -> torch.nn.Module:
        """The task's model inside megatron's DDP (and Float16Module) wrappers."""
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model)

    def _forward_step(self, data_iterator, model, return_schedule_plan: bool = False):
        """megatron's forward-step contract over the task's ``forward`` / ``loss_fn``; with
        ``return_schedule_plan`` (megatron's combined 1F1B schedule, which overlaps one
        micro-batch's MoE all-to-all with another's computation) the task returns the model's
        schedule plan in place of its output (``schedule_plan``)."""
        batch = next(data_iterator)
        if return_schedule_plan:
            output, loss_fn = self.task.schedule_plan(model, batch)
        else:
            output, loss_fn = self.task.forward(model, batch)

        def loss_func(out):
            loss_sum, count = loss_fn(out)
            count = torch.as_tensor(count, device=loss_sum.device).to(torch.int)
            return loss_sum, count, {"loss": (loss_sum.detach(), count)}

        return output, loss_func

    def _schedule(self, step: StepBatch, measuring: bool) -> _StepSums:
        """Every micro-batch forward and backward through megatron's schedule, the gradients reduced
        and their norm computed: the step's numbers on the device, nothing read back."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro_batches = step.micro_batches
        if self.num_microbatches is not None and len(micro_batches) != self.num_microbatches:
            raise ValueError(f"expected {self.num_microbatches} micro-batches, got {len(micro_batches)}")
        if not micro_batches:
            raise ValueError(f"DP rank {self.ctx.dp_rank} got no micro-batch for this step")
        self._measuring = measuring
        t0 = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        scheduled = self.task.before_schedule(self.inner_model, micro_batches)
        self._after_schedule = scheduled.after_schedule if scheduled is not None else None
        if scheduled is not None:
            micro_batches = scheduled.micro_batches
        # ChunkPipe pipelines the chunks of each micro-batch through the stages itself (chunk_pipe):
        # every stage runs the micro-batches one after another, with megatron's schedule without pipelining
        pp_schedule = 1 if self.seq_chunks > 1 else self.ctx.layout.pp
        forward_backward = get_forward_backward_func(pp_size=pp_schedule)
        with main_grad_fusion():  # the schedule reads main_grad: layers may add into it themselves
            losses = forward_backward(
                forward_step_func=self._forward_step,
                data_iterator=iter(micro_batches),
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=self.seq_length,
                micro_batch_size=self.micro_batch_size,
                forward_only=False,
            )
        compute_seconds = (self._compute_end - t0) if self._compute_end is not None else float("nan")
        self._compute_end = None
        offloaded = self.offload.reset_step() if self.offload is not None else None
        # loss sum, loss count, input tokens, FLOPs: counted once per DP replica; the host's numbers go in
        # as one tensor from the host (a single process needs no reduction: nothing is copied)
        counts_here = self.ctx.is_last_stage and self.ctx.tp_rank == 0  # TP ranks hold the same loss: once
        first_of_replica = counts_here and self.ctx.pgs.cp.rank() == 0
        host = [float(step.tokens or 0), float(step.flops or 0)] if first_of_replica else [0.0, 0.0]
        single = dist.get_world_size() == 1
        totals = torch.zeros(4, dtype=torch.float64, device=self.ctx.device)
        if counts_here:
            for entry in losses:
                loss_sum, count = entry["loss"]
                totals[0] += loss_sum.detach().double()
                totals[1] += count
        if not single:
            totals[2:] = torch.tensor(host, dtype=torch.float64).to(self.ctx.device, non_blocking=True)
            dist.all_reduce(totals)
        self.optimizer.prepare_grads()
        # the gradients are sums over the step's loss tokens (every DP and CP rank's): their per-token
        # mean is 1 / divisor of them
        divisor = totals[1].clamp(min=1)
        return _StepSums(loss=totals[0] / divisor, norm=grad_update.grad_norm(self.optimizer, self.ctx.device).double()
                         / divisor, divisor=divisor, totals=totals, host_totals=host if single else None,
                         compute_seconds=compute_seconds, offloaded=offloaded)

    def _output(self, sums: _StepSums, step: StepBatch) -> StepOutput:
        """The step's numbers, read back to the host in one read."""
        if sums.host_totals is None:
            on_device, on_host = [sums.loss, sums.norm, sums.totals[2], sums.totals[3]], None
        else:
            on_device, on_host = [sums.loss, sums.norm], sums.host_totals
        return read_step_output(step, on_device, on_host, compute_seconds=sums.compute_seconds,
                                offloaded_bytes=sums.offloaded)

    def forward_backward(self, step: StepBatch, measuring: bool = False) -> StepOutput:
        return self._output(self._schedule(step, measuring), step)

    def train_step(self, step: StepBatch, lr: float, measuring: bool = False) -> StepOutput:
        """The step, then the update at ``lr``: every gradient multiplied by one factor inside the
        optimizer step (the per-token mean, and the clipping ``clip_grad / (norm + 1e-6)`` where that
        is below 1, as megatron's clipping does). Where the optimizer skips on the device
        (``grad_update.skips_on_device``: torch's fused AdamW, ``adamw_step``) a non-finite step is
        skipped there and the numbers are read after the update is queued; otherwise they are read
        first and the update is applied only when they are finite."""
        sums = self._schedule(step, measuring)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        clip = self.train.clip_grad
        coefficient = (clip / (sums.norm + 1e-6)).clamp(max=1.0) if clip > 0 else torch.ones_like(sums.norm)
        multiplier = (coefficient / sums.divisor).to(torch.float32)
        if grad_update.skips_on_device(self.optimizer, self._own_adamw):
            found_inf = (~(sums.loss.isfinite() & sums.norm.isfinite())).to(torch.float32)
            self._update(multiplier, found_inf)
            return self._output(sums, step)
        out = self._output(sums, step)
        if finite(out):
            self._update(multiplier, None)
        else:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        return out

    def _update(self, multiplier: torch.Tensor, found_inf: torch.Tensor | None) -> None:
        if self._own_adamw:
            grad_update.adamw_update(self.optimizer, multiplier, self._adamw_step, found_inf, self._adamw_plans)
        else:
            grad_update.scale_into_step(self.optimizer, multiplier, self.optimizer.step_with_ready_grads, found_inf)

    # -- checkpoints ---------------------------------------------------------------------------
    def layout_record(self) -> dict:
        ctx = self.ctx
        return {"tp": ctx.layout.tp, "pp": ctx.layout.pp, "cp": ctx.layout.cp, "ep": ctx.layout.ep,
                "dp": ctx.dp_size, "world_size": ctx.world_size}

    def checkpoint_state(self) -> EngineState:
        from loongforge.core.training import megatron_checkpoint

        return megatron_checkpoint.engine_state(self)

    def load_checkpoint(self, ckpt, with_optimizer: bool) -> None:
        from loongforge.core.training import megatron_checkpoint

        megatron_checkpoint.load(self, ckpt, with_optimizer)

    def rng_state(self) -> dict:
        from megatron.core import tensor_parallel

        state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        if self.ctx.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def set_rng_state(self, state: dict) -> None:
        from megatron.core import tensor_parallel

        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
