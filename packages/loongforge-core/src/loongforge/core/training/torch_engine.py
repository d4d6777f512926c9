"""The PyTorch-native engine: any ``nn.Module`` under DDP, FSDP2 or HSDP (``parallel.data_parallel``),
with activation recomputation (``train.recompute``) and offloading (``train.offload_layers``), regional ``torch.compile`` (``train.compile``),
bf16 autocast over fp32 weights or pure bf16 (``train.precision``), AdamW (on CUDA one fused kernel:
``train.optimizer_kernel``), an optional EMA of the weights
(``ema.decay``) and LoRA (``lora.rank > 0``: ``loongforge.core.lora``, applied to the task's model
after its pretrained weights are read and before anything else touches it; only the adapters
train). Context parallelism (``parallel.cp``) is the model's to implement (the task
declares ``context_parallel = True`` and reads the CP group from ``ctx.pgs.cp``); tensor, pipeline
and expert parallelism belong to the megatron-core engine.

What the engine asks of the model (the task's ``build_model``), declared with neutral defaults by
``loongforge.core.training.torch_model.TorchModel``, which every model it trains subclasses:

- ``repeated_blocks()``: its repeated blocks, FSDP2's sharding units and the compile units;
- ``recompute_modes`` (the ``train.recompute`` values it implements besides ``none``) and
  ``set_recompute(mode)``;
- optionally ``compile_regions()``: its own regional compilation (default: ``torch.compile`` of
  each repeated block);
- optionally ``parts()``: ``{name: part}`` for a model whose parts are wrapped and trained
  separately (Wan 2.2's two experts; a ``StepBatch.part`` names the part a step trains; each
  part has the methods above); without it the model is one part;
- optionally ``fsdp_forward_methods``: names of methods besides ``forward`` that run the part
  under FSDP2 (a policy's ``sample_actions``).

Gradients: each micro-batch's summed loss is back-propagated as it is; after the last one the
loss sums and counts are all-reduced over the gradient group, and ``world / global count`` times
the (DP-averaged) gradients are the gradients of the global mean loss whatever the split over ranks
and micro-batches. ``train_step`` folds that factor and the clipping into one multiplier, which
the fused AdamW kernel applies inside it (with the step's non-finite flag), so the optimizer
step is the only pass over the gradients and the step's numbers are read once, after the update is
queued; ``forward_backward`` leaves the scaled gradients in ``.grad``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loongforge.core.kernels import get_op
from loongforge.core.training import grad_update, torch_parallel
from loongforge.core.training.activation_offload import offload_first
from loongforge.core.training.ema import EMA
from loongforge.core.training.engine import (EngineState, StepOutput, finite, precision_recipe, read_step_output,
                                             resolve_dtype)
from loongforge.core.training.schema import ParallelConfig, TrainConfig
from loongforge.core.training.sharding import local
from loongforge.core.training.task import StepBatch, TorchTask
from loongforge.core.training.torch_model import TorchModel


def check_parallel_config(parallel: ParallelConfig, context_parallel: bool) -> None:
    """What the PyTorch-native engine cannot do, as a config error (before any process group)."""
    for key in ("tp", "pp", "ep"):
        if getattr(parallel, key) != 1:
            raise ValueError(f"parallel.{key}={getattr(parallel, key)}: the PyTorch-native engine shards data "
                             f"(parallel.data_parallel) and, where the model implements it, context (parallel.cp)")
    if parallel.cp != 1 and not context_parallel:
        raise ValueError(f"parallel.cp={parallel.cp}: this model does not implement context parallelism")


def check_train_config(train: TrainConfig) -> None:
    if train.use_distributed_optimizer or train.overlap_grad_reduce:
        raise ValueError("train.use_distributed_optimizer / train.overlap_grad_reduce are megatron-core engine "
                         "options; shard the optimizer state with parallel.data_parallel=fsdp")


def model_parts(model: TorchModel) -> dict[str, TorchModel]:
    return model.parts()


@dataclass
class _StepSums:
    """A step's numbers on the device after its backward: ``sums`` (loss sum, loss count, tokens,
    FLOPs: global), ``scale`` (fp32: what turns the gradients into the global mean loss's), the
    parameters that got a gradient."""

    sums: torch.Tensor
    scale: torch.Tensor
    params: list[torch.nn.Parameter]
    compute_seconds: float
    offloaded: int | None


class TorchEngine:
    name = "torch"

    def __init__(self, task: TorchTask, ctx, train: TrainConfig, parallel: ParallelConfig, resuming: bool = False,
                 ema=None, lora=None):
        check_parallel_config(parallel, task.context_parallel)
        check_train_config(train)
        self.task, self.ctx, self.train, self.parallel = task, ctx, train, parallel
        self.device = ctx.device
        self.dtype = resolve_dtype(train.precision, ctx.device)
        # mixed: fp32 weights, grads and AdamW state, bf16 autocast; pure: all of them in bf16 (autocast
        # still casts fp32 inputs); the EMA weights stay fp32 either way
        self.precision = precision_recipe(train.precision, ctx.device)
        param_dtype = self.dtype if self.precision == "pure" else None
        self.group = ctx.pgs.dp_cp
        self.world = dist.get_world_size(self.group)
        self.mode = torch_parallel.data_parallel_mode(parallel.data_parallel, self.world)
        pretrained = task.has_pretrained and not resuming
        # pretrained weights under FSDP2, for a task whose load fills every tensor (buffers too): build
        # on the meta device, shard, then each rank reads only its rows; otherwise build on the host
        # (same seed: the same init on every rank)
        sharded_init = pretrained and self.mode in ("fsdp", "hsdp") and task.loads_into_shards
        torch.manual_seed(train.seed)
        with torch.device("meta") if sharded_init else contextlib.nullcontext():
            model = task.build_model(ctx)
        if pretrained and not sharded_init:
            task.load_pretrained(model)
        self.lora = lora if lora is not None and lora.enabled else None
        self.adapted: list[str] = []
        if self.lora is not None:  # before compile, recomputation and wrapping see the model
            from loongforge.core.lora import apply_lora

            self.adapted = apply_lora(model, self.lora, seed=train.seed)
        if not sharded_init:
            model.to(self.device)
        if param_dtype is not None:  # (on the meta device under a sharded init: to_empty keeps the dtype)
            model.to(param_dtype)
        self.model = model
        self.parts = model_parts(model)
        self._prepare_parts(train)
        self.wrapped = {name: torch_parallel.wrap(part, self.mode, self.group, self.device, self.dtype,
                                                  parallel.dp_replicate, pure=self.precision == "pure")
                        for name, part in self.parts.items()}
        if sharded_init:
            model.to_empty(device=self.device)
            task.load_pretrained(model)  # the base weights; the loader leaves the adapters alone
            if self.lora is not None:
                from loongforge.core.lora import init_adapters

                init_adapters(model, train.seed)
        if self.lora is not None and self.lora.base and not resuming:
            from loongforge.core.training.torch_checkpoint import load_base

            load_base(self, self.lora.base)
        self.named_trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.named_trainable:
            raise ValueError(f"model family {task.family!r}: no trainable parameter")
        self.optimizer = torch.optim.AdamW(
            list(self.named_trainable.values()), lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps, weight_decay=train.weight_decay, fused=self.device.type == "cuda",
        )
        # train.optimizer_kernel=loongforge: the update of plain (unsharded) parameters through the
        # registry's adamw_step (CUDA, loongforge-kernels installed, every parameter contiguous, as the
        # kernel needs; the optimizer's state as torch's fused AdamW keeps it, so checkpoints are the
        # same); otherwise torch's fused AdamW
        self._adamw_step = ctx.kernels.get("adamw_step")
        self._own_adamw = (train.optimizer_kernel == "loongforge" and self.device.type == "cuda"
                           and self._adamw_step is not get_op("adamw_step").reference
                           and all(p.is_contiguous() for p in self.named_trainable.values()))
        self._adamw_plans: dict = {}  # adamw_step's launch tables, kept between steps
        decay = ema.decay if ema is not None else 0.0
        self.ema = EMA(self.named_trainable, decay) if decay > 0 else None
        self.ema_interval = ema.update_interval if ema is not None else 1
        self.updates = 0  # applied updates (the EMA cadence); a resumed run restores it
        self._adapters_checked: set[str] = set()  # parts whose first step found a gradient on every adapter

    def _prepare_parts(self, train: TrainConfig) -> None:
        """Activation recomputation and offloading, then regional compilation, per part (before
        wrapping, as torchtitan orders them)."""
        compile_requested = train.compile
        self.offloads = []
        for name, part in self.parts.items():
            modes = ("none", *part.recompute_modes)
            if train.recompute not in modes:
                raise ValueError(f"train.recompute={train.recompute!r}: model family {self.task.family!r} implements "
                                 f"{', '.join(modes)}")
            part.set_recompute(train.recompute)
            offload = offload_first(part.repeated_blocks(), train.offload_layers, self.device)
            if offload is not None:
                self.offloads.append(offload)
        if self.compiles(compile_requested):
            for part in self.parts.values():
                part.compile_regions()

    def compiles(self, requested: bool | None) -> bool:
        """``train.compile``; when null, on CUDA unless the task says its model cannot be compiled in
        this run (``compile_default(ctx)``)."""
        if requested is not None:
            return requested
        return self.task.compile_default(self.ctx)

    @property
    def inner_model(self) -> torch.nn.Module:
        """The task's model (FSDP2 shards it in place; DDP wrappers are kept apart in ``wrapped``)."""
        return self.model

    # -- one step ---------------------------------------------------------------------------
    def _backward(self, step: StepBatch, measuring: bool) -> _StepSums:
        """Every micro-batch's summed loss back-propagated as it is (the gradients are sums over the
        step's loss tokens, DP-averaged), the sums all-reduced: nothing read back to the host."""
        part = step.part or next(iter(self.wrapped))
        if part not in self.wrapped:
            raise KeyError(f"step trains part {part!r}; the model has {sorted(self.wrapped)}")
        module = self.wrapped[part]
        micro_batches = step.micro_batches
        t0 = time.perf_counter()
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss sum, count, tokens, FLOPs
        uneven = False
        if self.world > 1 and torch_parallel.is_fsdp(module):  # the same answer on every rank
            extremes = torch.tensor([len(micro_batches), -len(micro_batches)], device=self.device)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
            uneven = int(extremes[0]) != -int(extremes[1])
        with torch_parallel.accumulation(module, uneven):
            for k, micro in enumerate(micro_batches):
                with torch_parallel.gradient_sync(module, k == len(micro_batches) - 1):
                    with torch_parallel.autocast(self.device.type, self.dtype):
                        output, loss_fn = self.task.forward(module, micro)
                    loss_sum, count = loss_fn(output)
                    loss_sum.backward()
                sums[0] += loss_sum.detach().double()
                # (a count on the device is added there, with no read back)
                sums[1] += count.detach() if isinstance(count, torch.Tensor) else float(count)
        if self.lora is not None and part not in self._adapters_checked:
            self._check_adapters_used(part)
        if measuring:
            self.ctx.accelerator.synchronize()
        compute_seconds = time.perf_counter() - t0
        offloaded = sum(offload.reset_step() for offload in self.offloads) if self.offloads else None
        if self.ctx.pgs.cp.rank() == 0:
            sums[2], sums[3] = float(step.tokens or 0), float(step.flops or 0)
        if self.world > 1:
            dist.all_reduce(sums, group=self.group)
        params = [p for p in self.named_trainable.values() if p.grad is not None]
        # the gradients of the global mean loss are these times world / (global loss count)
        scale = (self.world / sums[1].clamp(min=1e-30)).to(torch.float32)
        return _StepSums(sums=sums, scale=scale, params=params, compute_seconds=compute_seconds,
                         offloaded=offloaded)

    def _grad_norm_of(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The global L2 norm of ``params``' gradients as they stand, an fp32 device scalar."""
        if not params:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.to(torch.float32)

    @staticmethod
    def _output(b: _StepSums, step: StepBatch, norm: torch.Tensor) -> StepOutput:
        """The step's numbers, read back to the host in one read."""
        loss = b.sums[0] / b.sums[1].clamp(min=1e-30)
        return read_step_output(step, [loss, norm.double(), b.sums[2], b.sums[3]],
                                compute_seconds=b.compute_seconds, offloaded_bytes=b.offloaded)

    def forward_backward(self, step: StepBatch, measuring: bool = False) -> StepOutput:
        """The step's gradients, left in ``.grad`` as those of the global mean loss (the weights untouched)."""
        b = self._backward(step, measuring)
        grads = [local(p.grad) for p in b.params]
        if grads:
            torch._foreach_mul_(grads, b.scale)
        return self._output(b, step, self._grad_norm_of(b.params))

    def _check_adapters_used(self, part: str) -> None:
        """A trainable adapter without a gradient after a step of its part was never called: the
        model's forward uses that layer's weight without its adapter (``lora_delta``)."""
        mine = {id(p) for p in self.parts[part].parameters()}
        unused = [n for n, p in self.named_trainable.items() if id(p) in mine and p.grad is None]
        anywhere = torch.tensor(float(len(unused)), device=self.device)
        if self.world > 1:  # every rank decides alike
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=self.group)
        if anywhere.item():
            from loongforge.core.config import ConfigError

            layers = sorted({n.rsplit(".", 2)[0] for n in unused}) or ["(on another rank)"]
            assert self.lora is not None  # only a LoRA run has adapters to check
            raise ConfigError(f"lora.target_modules={list(self.lora.target_modules)}: the forward of model family "
                             f"{self.task.family!r} never ran the adapters of {layers[:4]}"
                             f"{' ...' if len(layers) > 4 else ''} (it uses those layers' weights directly); "
                             "leave them out of the targets")
        self._adapters_checked.add(part)

    def train_step(self, step: StepBatch, lr: float, measuring: bool = False) -> StepOutput:
        """The step, then the update at ``lr`` with every gradient multiplied by one factor: the
        per-token mean (``world / global count``) and the clipping ``clip_grad / (norm + 1e-6)``
        where that is below 1, as ``torch.nn.utils.clip_grad_norm_``. Over plain (unsharded) tensors
        the factor and the non-finite flag go into the update's kernel: the registry's ``adamw_step``
        (``train.optimizer_kernel=loongforge``, ``grad_update.adamw_update_groups``) or torch's fused
        AdamW (``grad_update.fused_adamw_hooks``): no pass over the gradients of its own and nothing
        read back before the update is queued. Otherwise one multi-tensor multiply, after the numbers are
        read and found finite. A step whose loss or norm is not finite is never applied."""
        b = self._backward(step, measuring)
        norm = self._grad_norm_of(b.params) * b.scale
        clip = self.train.clip_grad
        coefficient = (clip / (norm + 1e-6)).clamp(max=1.0) if clip > 0 else torch.ones_like(norm)
        multiplier = b.scale * coefficient
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        plain = not any(isinstance(p, DTensor) for p in b.params)
        if plain and (self._own_adamw or grad_update.is_fused_adamw(self.optimizer)):
            loss = b.sums[0] / b.sums[1].clamp(min=1e-30)
            found_inf = (~(loss.isfinite() & norm.isfinite())).to(torch.float32)
            if self._own_adamw:
                grad_update.adamw_update_groups(self.optimizer, multiplier, self._adamw_step, found_inf,
                                                self._adamw_plans)
            else:
                with grad_update.fused_adamw_hooks([self.optimizer], 1.0 / multiplier, found_inf):
                    self.optimizer.step()
            out = self._output(b, step, norm)
            applied = finite(out)
        else:
            out = self._output(b, step, norm)
            applied = finite(out)
            if applied:
                grads = [local(p.grad) for p in b.params]
                if grads:
                    torch._foreach_mul_(grads, multiplier)
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if applied:
            self.updates += 1
            if self.ema is not None and self.updates % self.ema_interval == 0:
                self.ema.update()
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def layout_record(self) -> dict:
        return {"dp": self.ctx.dp_size, "cp": self.ctx.layout.cp, "data_parallel": self.mode,
                "dp_replicate": self.parallel.dp_replicate, "world_size": self.ctx.world_size}

    def checkpoint_state(self) -> EngineState:
        from loongforge.core.training import torch_checkpoint

        return torch_checkpoint.engine_state(self)

    def load_checkpoint(self, ckpt, with_optimizer: bool) -> None:
        from loongforge.core.training import torch_checkpoint

        torch_checkpoint.load(self, ckpt, with_optimizer)

    def rng_state(self) -> dict:
        state = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"])
