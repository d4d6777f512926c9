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
- ``token_scaling``: the per-token loss normalisation ``1 / tokens`` of the global batch
  (megatron's ``finalize_model_grads`` multiplies every gradient by it in a pass of its own; the
  engine asks it not to and folds the factor into the update instead).
- ``scale_into_step``: the step's gradient multiplier (token normalisation times the clipping
  coefficient) handed to torch's fused AdamW as its ``grad_scale`` (the tensor it divides every
  gradient by inside the update kernel, the hook ``torch.amp.GradScaler`` uses), or one
  multi-tensor multiply where the optimizer is not fused.
"""

from __future__ import annotations

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


def token_scaling(num_tokens: torch.Tensor, pp_group, dp_cp_group) -> torch.Tensor:
    """``1 / tokens`` of the global batch from this rank's count (set on the last pipeline
    stage): broadcast from that stage over ``pp_group``, summed over ``dp_cp_group``, as
    megatron's ``finalize_model_grads`` does with ``calculate_per_token_loss``."""
    num_tokens = num_tokens.to(torch.float32).clone()
    if dist.is_initialized() and pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.broadcast(num_tokens, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    _reduce(num_tokens, dp_cp_group)
    return 1.0 / num_tokens.clamp(min=1)


def _fused(sub) -> bool:
    inner = getattr(sub, "optimizer", None)
    return inner is not None and bool(inner.param_groups) and all(g.get("fused") for g in inner.param_groups)


def scale_into_step(optimizer, multiplier: torch.Tensor, step) -> None:
    """Run ``step()`` (megatron's ``step_with_ready_grads``) with every gradient multiplied by
    ``multiplier`` (an fp32 device scalar): inside torch's fused AdamW kernel (``grad_scale =
    1 / multiplier``) where every sub-optimizer is fused, else by one multi-tensor multiply first."""
    subs = sub_optimizers(optimizer)
    if subs and all(_fused(sub) for sub in subs):
        divisor = (1.0 / multiplier).to(torch.float32)
        inners = [sub.optimizer for sub in subs]
        for inner in inners:
            inner.grad_scale = divisor
        try:
            step()
        finally:
            for inner in inners:
                del inner.grad_scale
        return
    grads = [p.grad for sub in subs for p in sub.get_parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, multiplier.to(grads[0].device))
    step()
