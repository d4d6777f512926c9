"""AdamW over a list of tensors in one Triton kernel: ``adamw_step``'s fused version.

Contract: ``loongforge.core.kernels.adamw.adamw_step``. The tensors stay where they are: the
kernel gets a small table per list (each tensor's address for the param, its gradient, its two
moments and its step count, and the running count of ``BLOCK``-element blocks before it). Program ``i`` finds its
tensor by a binary search in that table and updates one block of it: every element read once and
written once, with fully coalesced loads, in one launch for the whole list (torch's fused AdamW
launches a kernel per few hundred 64K-element chunks, with fewer blocks in flight). The tensors of
one launch share their dtypes (the host function groups them); the step counts and the gradient
factor are read on the device, so nothing is read back to the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.adamw import check_adamw_lists
from loongforge.kernels.launch import check_tensors

BLOCK = 4096  # elements per program

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _adamw_tensor_list(
    TABLE, n_tensors, SCALE,
    lr, beta1, beta2, eps, weight_decay, log_beta1, log_beta2,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # TABLE rows: 0 param, 1 grad, 2 exp_avg, 3 exp_avg_sq, 4 step addresses, 5 numel, 6 first block
    # (n + 1 entries each)
    lo = tl.zeros((), dtype=tl.int64)
    hi = lo + n_tensors  # (an int argument may arrive specialised as a constant)
    for _ in tl.static_range(SEARCH_STEPS):  # the last tensor whose first block is <= pid
        mid = (lo + hi) // 2
        go_right = tl.load(TABLE + 6 * (n_tensors + 1) + mid) <= pid
        lo = tl.where(go_right & (mid > lo), mid, lo)
        hi = tl.where(go_right, hi, mid)
    t = lo
    numel = tl.load(TABLE + 5 * (n_tensors + 1) + t)
    offs = (pid - tl.load(TABLE + 6 * (n_tensors + 1) + t)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p_ptr = tl.load(TABLE + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(TABLE + (n_tensors + 1) + t).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(TABLE + 2 * (n_tensors + 1) + t).to(tl.pointer_type(P_DTYPE))
    v_ptr = tl.load(TABLE + 3 * (n_tensors + 1) + t).to(tl.pointer_type(P_DTYPE))
    n = tl.load(tl.load(TABLE + 4 * (n_tensors + 1) + t).to(tl.pointer_type(tl.float32)))
    scale = tl.load(SCALE).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp(n * log_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(n * log_beta2))
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
    tl.store(m_ptr + offs, m.to(P_DTYPE), mask=mask)
    tl.store(v_ptr + offs, v.to(P_DTYPE), mask=mask)


def _table(params, grads, exp_avgs, exp_avg_sqs, steps, device) -> tuple[torch.Tensor, int]:
    """The launch table of one list (rows: addresses, numel, first block) and its block count."""
    blocks, first = 0, []
    for p in params:
        first.append(blocks)
        blocks += triton.cdiv(p.numel(), BLOCK)
    first.append(blocks)
    pad = [0]
    rows = [[t.data_ptr() for t in ts] + pad for ts in (params, grads, exp_avgs, exp_avg_sqs, steps)]
    rows += [[p.numel() for p in params] + pad, first]
    return torch.tensor(rows, dtype=torch.int64).to(device), blocks


@torch.no_grad()
def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, grad_scale: torch.Tensor) -> None:
    """Fused ``loongforge.core.kernels.adamw.adamw_step``: one launch per group of tensors that share
    their param and gradient dtypes (the step counts: fp32, on the params' device)."""
    check_adamw_lists(params, grads, exp_avgs, exp_avg_sqs, steps)
    if not params:
        return
    device = check_tensors("adamw_step", *params, *grads, *exp_avgs, *exp_avg_sqs, *steps, grad_scale)
    if any(n.dtype != torch.float32 for n in steps):
        raise ValueError("adamw_step: the step counts must be fp32 tensors")
    groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"adamw_step: tensor {i} (shape {tuple(p.shape)}) is not contiguous in all four lists")
        if not m.dtype == v.dtype == p.dtype:
            raise ValueError(f"adamw_step: tensor {i}: the moments ({m.dtype}, {v.dtype}) are not in the param's "
                             f"dtype {p.dtype}")
        if p.numel():
            groups.setdefault((p.dtype, g.dtype), []).append(i)
    scale32 = grad_scale.to(device=device, dtype=torch.float32)
    for (p_dtype, g_dtype), index in groups.items():
        pick = [[lst[i] for i in index] for lst in (params, grads, exp_avgs, exp_avg_sqs, steps)]
        table, blocks = _table(*pick, device)
        _adamw_tensor_list[(blocks,)](
            table, len(index), scale32,
            lr, beta1, beta2, eps, weight_decay, math.log(beta1), math.log(beta2),
            P_DTYPE=_TL[p_dtype], G_DTYPE=_TL[g_dtype], SEARCH_STEPS=max(1, (len(index)).bit_length()),
            BLOCK=BLOCK, num_warps=8,
        )
