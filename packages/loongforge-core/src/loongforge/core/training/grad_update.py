"""The gradient arithmetic between the megatron-core engine's backward and its optimizer step,
without a host read per tensor and with as few passes over the gradients as the optimizer allows.

megatron-core without Transformer Engine or Apex computes the global norm one tensor at a time,
reading each tensor's norm back to the host (a device synchronisation per parameter), and scales
gradients with a multiply and a copy per tensor. Here:

- ``grad_norm``: each sub-optimizer's gradients (``get_grads_for_grad_norm``: tensor-parallel
  duplicates and shared parameters left out, as megatron does) go through one multi-tensor norm,
  squared and summed on the device, then summed over the sub-optimizer's statistics group
  (``get_grad_stats_parallel_group``), as ``get_grad_norm_fp32`` does; the result stays on the
  device.
- ``adamw_update`` (``train.optimizer_kernel=loongforge``, CUDA, the fused kernels installed): the
  update itself through the registry's ``adamw_step`` (one kernel over a param group's tensors,
  the step's clipping factor applied inside it) in place of megatron's
  ``step_with_ready_grads`` around torch's AdamW; ``adamw_update_groups`` the same over one torch
  AdamW (the PyTorch-native engine's).
- ``scale_into_step`` otherwise: the step's factor (per-token mean and clipping) handed to torch's
  fused AdamW as its ``grad_scale`` (the tensor it divides every gradient by inside the update
  kernel, the hook ``torch.amp.GradScaler`` uses), or one multi-tensor multiply where the
  optimizer is not fused.
- ``skips_on_device``: whether the update can take the step's non-finite flag as a device tensor
  (fused AdamW's ``found_inf``, ``adamw_step``'s): then a non-finite step is skipped inside the
  update kernels and nothing is read back to the host between the backward and the update.
- ``fused_adamw_hooks``: the two device tensors torch's fused AdamW reads in its step, for the
  duration of one step (this module's megatron path and the PyTorch-native engine both use it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist


def sub_optimizers(optimizer) -> list:
    """megatron's optimizer as the list of its sub-optimizers (one unless it is a ``ChainedOptimizer``)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _reduce(value: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def grad_norm(optimizer, device: torch.device) -> torch.Tensor:
    """The global L2 norm of the gradients megatron's ``get_grad_norm`` covers, as an fp32 device
    scalar (no host read)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for sub in sub_optimizers(optimizer):
        grads = [g for g in sub.get_grads_for_grad_norm() if g.numel()]
        squared = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            squared = torch.stack(norms).square().sum().to(device)
        total += _reduce(squared, sub.get_grad_stats_parallel_group())
    return total.sqrt()


def _fused(sub) -> bool:
    inner = getattr(sub, "optimizer", None)
    return inner is not None and is_fused_adamw(inner)


def skips_on_device(optimizer, own_adamw: bool) -> bool:
    """Whether the update of ``optimizer`` takes a device flag that skips it (``found_inf``): every
    sub-optimizer torch's fused AdamW, or the update through ``adamw_step`` (``own_adamw``)."""
    subs = sub_optimizers(optimizer)
    return own_adamw or (bool(subs) and all(_fused(sub) for sub in subs))


def scale_into_step(optimizer, multiplier: torch.Tensor | None, step, found_inf: torch.Tensor | None = None) -> None:
    """Run ``step()`` (megatron's ``step_with_ready_grads``) with every gradient multiplied by
    ``multiplier`` (an fp32 device scalar; None: by nothing): inside torch's fused AdamW kernel
    (``grad_scale = 1 / multiplier``) where every sub-optimizer is fused, else by one multi-tensor
    multiply first. ``found_inf`` (fp32 device scalar, fused AdamW only: ``skips_on_device``): 1
    leaves the weights, moments and step counts as they were."""
    subs = sub_optimizers(optimizer)
    fused = bool(subs) and all(_fused(sub) for sub in subs)
    if found_inf is not None and not fused:
        raise ValueError("scale_into_step: found_inf needs torch's fused AdamW in every sub-optimizer")
    if multiplier is None and found_inf is None:
        step()
        return
    if fused:
        grad_scale = (1.0 / multiplier).to(torch.float32) if multiplier is not None else None
        with fused_adamw_hooks([sub.optimizer for sub in subs], grad_scale, found_inf):
            step()
        return
    assert multiplier is not None
    grads = [p.grad for sub in subs for p in sub.get_parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, multiplier.to(grads[0].device))
    step()


def is_fused_adamw(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every param group of ``optimizer`` (a torch optimizer) steps through a fused kernel,
    which reads ``grad_scale`` and ``found_inf`` (``fused_adamw_hooks``)."""
    return bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)


@contextlib.contextmanager
def fused_adamw_hooks(optimizers: Sequence[torch.optim.Optimizer], grad_scale: torch.Tensor | None,
                      found_inf: torch.Tensor | None) -> Iterator[None]:
    """For the steps taken inside it, torch's fused AdamW (``is_fused_adamw``) divides every gradient
    by ``grad_scale`` inside its kernel and leaves the weights, moments and step counts as they were
    where ``found_inf`` is 1 (fp32 device scalars; None: not set): the attributes its ``step()`` reads,
    the hook ``torch.amp.GradScaler`` uses, removed again on the way out."""
    hooks = {name: value for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)) if value is not None}
    for optimizer in optimizers:
        for name, value in hooks.items():
            setattr(optimizer, name, value)
    try:
        yield
    finally:
        for optimizer in optimizers:
            for name in hooks:
                delattr(optimizer, name)


def adamw_applies(optimizer) -> bool:
    """Whether ``adamw_update`` can step ``optimizer``: each sub-optimizer is megatron's
    ``FP32Optimizer`` (pure bf16, fp32) or ``Float16OptimizerWithFloat16Params`` (mixed precision)
    around torch's AdamW without amsgrad or maximize (the distributed optimizer keeps its own
    shard bookkeeping: torch's fused AdamW steps it)."""
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    subs = sub_optimizers(optimizer)
    return bool(subs) and all(
        isinstance(sub, FP32Optimizer | Float16OptimizerWithFloat16Params)
        and isinstance(sub.optimizer, torch.optim.AdamW)
        and not any(g.get("amsgrad") or g.get("maximize") for g in sub.optimizer.param_groups)
        for sub in subs
    )


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``p``'s AdamW state, made as torch's fused AdamW makes it on the first step (step count on
    the param's device), so checkpoints and torch's own step read it alike."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif state["step"].device != p.device:
        state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return state


@torch.no_grad()
def adamw_update_groups(optimizer: torch.optim.Optimizer, multiplier: torch.Tensor, adamw_step,
                        found_inf: torch.Tensor | None = None, plans: dict | None = None) -> None:
    """One AdamW update of every param group of ``optimizer`` (torch's AdamW without amsgrad or
    maximize, its state as torch's fused AdamW keeps it) through the registry op ``adamw_step``
    (one kernel per param group), every gradient multiplied by ``multiplier`` inside it, skipped
    where ``found_inf`` is 1. ``plans``: the caller's dict for ``adamw_step`` to keep its launch
    tables in between steps."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [_adam_state(optimizer, p) for p in params]
        steps = [state["step"] for state in states]
        if found_inf is None:
            torch._foreach_add_(steps, 1)
        else:  # (a list of device scalars: the one-tensor form reads its scalar back to the host)
            torch._foreach_add_(steps, [1 - found_inf] * len(steps))
        beta1, beta2 = group["betas"]
        adamw_step(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                   [s["exp_avg_sq"] for s in states], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                   eps=group["eps"], weight_decay=group["weight_decay"], grad_scale=multiplier,
                   found_inf=found_inf, plans=plans)


@torch.no_grad()
def adamw_update(optimizer, multiplier: torch.Tensor, adamw_step, found_inf: torch.Tensor | None = None,
                 plans: dict | None = None) -> None:
    """One AdamW update of every parameter of megatron's ``optimizer`` (``adamw_applies``) through
    ``adamw_update_groups`` per sub-optimizer; in mixed precision the bf16 model weights are then
    refreshed from the fp32 main weights by one multi-tensor copy. What megatron's
    ``step_with_ready_grads`` does around torch's AdamW, in fewer passes."""
    from megatron.core.optimizer import Float16OptimizerWithFloat16Params

    for sub in sub_optimizers(optimizer):
        adamw_update_groups(sub.optimizer, multiplier, adamw_step, found_inf, plans)
        if isinstance(sub, Float16OptimizerWithFloat16Params):
            for model_params, main_params in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                if model_params:
                    torch._foreach_copy_(model_params, main_params)
