"""AdamW's update over lists of tensors: the reference of the ``adamw_step`` op.

``adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay,
grad_scale, found_inf=None, plans=None)`` applies ``torch.optim.AdamW``'s update to every ``param`` in place, with its moments
``exp_avg`` / ``exp_avg_sq``, after multiplying each gradient by ``grad_scale`` (a 0-d fp32 tensor:
the step's per-token normalisation times its clipping factor). ``steps`` holds each tensor's 0-d
fp32 step count: the number of this update, counted from 1 (the optimizer's ``state["step"]``,
already advanced). The math is fp32 whatever the tensors' dtypes (bf16 weights and moments under
pure bf16, fp32 main weights in mixed precision); results are stored in each tensor's own dtype,
as torch's fused AdamW does. ``found_inf`` (a 0-d fp32 tensor, optional) of 1 leaves every tensor
as it was (the step was not finite), decided on the device as fused AdamW's ``found_inf`` is.
``plans`` (optional): a dict the caller keeps between calls, where an implementation may keep what
it prepared for a list of tensors (the fused one: its launch tables, by the tensors' addresses):

    p = p * (1 - lr * weight_decay)
    m = lerp(m, g, 1 - beta1)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1 ** n) * m / (sqrt(v) / sqrt(1 - beta2 ** n) + eps)

The fused version in ``loongforge-kernels`` runs one kernel over all the tensors of a list; this
one is a loop of torch ops, for any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_adamw_lists(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                      steps: Sequence[torch.Tensor]) -> None:
    """Five lists of one length whose i-th tensors share a shape (the step counts: one element);
    else a ``ValueError``."""
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(steps):
        raise ValueError(f"adamw_step: {len(params)} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs, "
                         f"{len(exp_avg_sqs)} exp_avg_sqs and {len(steps)} steps")
    for i, (p, g, m, v, n) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        if not p.shape == g.shape == m.shape == v.shape or n.numel() != 1:
            raise ValueError(f"adamw_step: tensor {i}: param {tuple(p.shape)}, grad {tuple(g.shape)}, exp_avg "
                             f"{tuple(m.shape)}, exp_avg_sq {tuple(v.shape)}, step {tuple(n.shape)}")


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
               exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, grad_scale: torch.Tensor,
               found_inf: torch.Tensor | None = None, plans: dict | None = None) -> None:
    """One AdamW update of every tensor in place (see the module docstring; ``plans`` is unused here)."""
    check_adamw_lists(params, grads, exp_avgs, exp_avg_sqs, steps)
    if found_inf is not None and bool(found_inf):
        return
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        n = step.to(device=p.device, dtype=torch.float32)
        gf = g.float() * grad_scale.to(device=p.device, dtype=torch.float32)
        pf, mf, vf = p.float(), m.float(), v.float()
        pf = pf * (1 - lr * weight_decay)
        mf = torch.lerp(mf, gf, 1 - beta1)
        vf = vf * beta2 + (1 - beta2) * gf * gf
        bias1 = 1 - torch.pow(beta1, n)
        bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, n))
        pf = pf - (lr / bias1) * mf / (vf.sqrt() / bias2_sqrt + eps)
        p.copy_(pf)
        m.copy_(mf)
        v.copy_(vf)
