"""AdamW over a list of tensors in one Triton kernel: ``adamw_step``'s fused version.

Contract: ``loongforge.core.kernels.adamw.adamw_step``. The tensors stay where they are: the
kernel gets, per list, the tensor of lowest address as its base and a small table (each tensor's
element offset from its list's base for the param, its gradient and its two moments, its step
count's address, its numel and the running count of ``BLOCK``-element blocks before it). Program
``i`` finds its tensor by a binary search in that table and updates one block of it: every element
read once and written once, in one launch for the whole list (torch's fused AdamW launches a kernel
per few hundred 64K-element chunks, with fewer blocks in flight). Offsets from a typed base keep
what Triton knows of alignment: where every tensor starts on 16 bytes and holds a multiple of 16
elements (the host checks; nearly every weight of a model) the launch is told so and moves 16
bytes per access, where an address read from the table would leave it 2-byte accesses. The
tensors of one launch share their dtypes and alignment (the host groups them); the step counts and
the gradient factor (and the flag that skips a non-finite step) are read on the device, so
nothing is read back to the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.adamw import check_adamw_lists
from loongforge.kernels.launch import check_tensors

BLOCK = 4096  # elements per program
MAX_PLANS = 8  # launch tables kept in a caller's ``plans`` (one per param group and dtype mix is plenty)


@triton.jit
def _adamw_tensor_list(
    TABLE, n_tensors, SCALE, SKIP, P_BASE, G_BASE, M_BASE, V_BASE,
    lr, beta1, beta2, eps, weight_decay, log_beta1, log_beta2,
    SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr, P_ALIGN: tl.constexpr, G_ALIGN: tl.constexpr,
    N_ALIGN: tl.constexpr, HAS_SKIP: tl.constexpr,
):
    if HAS_SKIP:  # the step was not finite: nothing changes
        if tl.load(SKIP) != 0:
            return
    pid = tl.program_id(0).to(tl.int64)
    # TABLE rows: 0 param, 1 grad, 2 exp_avg, 3 exp_avg_sq element offsets from their bases, 4 step addresses,
    # 5 numel, 6 first block (n + 1 entries each)
    lo = tl.zeros((), dtype=tl.int64)
    hi = lo + n_tensors  # (an int argument may arrive specialised as a constant)
    for _ in tl.static_range(SEARCH_STEPS):  # the last tensor whose first block is <= pid
        mid = (lo + hi) // 2
        go_right = tl.load(TABLE + 6 * (n_tensors + 1) + mid) <= pid
        lo = tl.where(go_right & (mid > lo), mid, lo)
        hi = tl.where(go_right, hi, mid)
    t = lo
    row = n_tensors + 1
    # where the host found every tensor 16-byte aligned with a multiple of 16 elements: P_ALIGN / G_ALIGN
    # the elements per 16 bytes, N_ALIGN 16 (else 1)
    numel = tl.multiple_of(tl.load(TABLE + 5 * row + t), N_ALIGN)
    p_off = tl.multiple_of(tl.load(TABLE + t), P_ALIGN)
    g_off = tl.multiple_of(tl.load(TABLE + row + t), G_ALIGN)
    m_off = tl.multiple_of(tl.load(TABLE + 2 * row + t), P_ALIGN)
    v_off = tl.multiple_of(tl.load(TABLE + 3 * row + t), P_ALIGN)
    offs = (pid - tl.load(TABLE + 6 * row + t)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    n = tl.load(tl.load(TABLE + 4 * row + t).to(tl.pointer_type(tl.float32)))
    scale = tl.load(SCALE).to(tl.float32)
    g = tl.load(G_BASE + g_off + offs, mask=mask, other=0.0).to(tl.float32) * scale
    p = tl.load(P_BASE + p_off + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M_BASE + m_off + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V_BASE + v_off + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp(n * log_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(n * log_beta2))
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(P_BASE + p_off + offs, p.to(P_BASE.dtype.element_ty), mask=mask)
    tl.store(M_BASE + m_off + offs, m.to(M_BASE.dtype.element_ty), mask=mask)
    tl.store(V_BASE + v_off + offs, v.to(V_BASE.dtype.element_ty), mask=mask)


def _aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on 16 bytes and holds a multiple of 16 elements."""
    return all(t.data_ptr() % 16 == 0 and t.numel() % 16 == 0 for t in tensors)


def _table(lists, device) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The launch table of one group (rows: element offsets from each list's base, step addresses,
    numel, first block), the four bases (the lowest-addressed tensor of each list) and the block count."""
    params = lists[0]
    blocks, first = 0, []
    for p in params:
        first.append(blocks)
        blocks += triton.cdiv(p.numel(), BLOCK)
    first.append(blocks)
    pad = [0]
    bases = [min(ts, key=lambda t: t.data_ptr()) for ts in lists[:4]]
    rows = [[(t.data_ptr() - base.data_ptr()) // t.element_size() for t in ts] + pad for ts, base in zip(lists[:4], bases)]
    rows += [[n.data_ptr() for n in lists[4]] + pad, [p.numel() for p in params] + pad, first]
    return torch.tensor(rows, dtype=torch.int64).to(device), bases, blocks


@dataclass(frozen=True)
class _Launch:
    """One launch of ``_adamw_tensor_list``: its table, bases and grid, and what its tensors share."""

    table: torch.Tensor
    bases: list[torch.Tensor]
    blocks: int
    n_tensors: int
    p_align: int
    g_align: int
    n_align: int


def _launches(params, grads, exp_avgs, exp_avg_sqs, steps, device) -> list[_Launch]:
    """The launches of one call: the tensors checked and grouped by dtypes and alignment."""
    if any(n.dtype != torch.float32 for n in steps):
        raise ValueError("adamw_step: the step counts must be fp32 tensors")
    groups: dict[tuple[torch.dtype, torch.dtype, bool], list[int]] = {}
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"adamw_step: tensor {i} (shape {tuple(p.shape)}) is not contiguous in all four lists")
        if not m.dtype == v.dtype == p.dtype:
            raise ValueError(f"adamw_step: tensor {i}: the moments ({m.dtype}, {v.dtype}) are not in the param's "
                             f"dtype {p.dtype}")
        if any(t.data_ptr() % t.element_size() for t in (p, g, m, v)):
            raise ValueError(f"adamw_step: tensor {i} (shape {tuple(p.shape)}) does not start on a whole element")
        if p.numel():
            groups.setdefault((p.dtype, g.dtype, _aligned(p, g, m, v)), []).append(i)
    launches = []
    for (p_dtype, g_dtype, aligned), index in groups.items():
        pick = [[lst[i] for i in index] for lst in (params, grads, exp_avgs, exp_avg_sqs, steps)]
        table, bases, blocks = _table(pick, device)
        align = (16 // p_dtype.itemsize, 16 // g_dtype.itemsize, 16) if aligned else (1, 1, 1)
        launches.append(_Launch(table, bases, blocks, len(index), *align))
    return launches


@torch.no_grad()
def adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, grad_scale: torch.Tensor, found_inf: torch.Tensor | None = None,
               plans: dict | None = None) -> None:
    """Fused ``loongforge.core.kernels.adamw.adamw_step``: one launch per group of tensors that share
    their param and gradient dtypes and alignment (the step counts: fp32, on the params' device).
    ``plans``: the caller's dict, where the launch tables of the last few tensor lists are kept by
    the tensors' addresses, so that a step over the same tensors builds and copies nothing."""
    check_adamw_lists(params, grads, exp_avgs, exp_avg_sqs, steps)
    if not params:
        return
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    key = (*(t.data_ptr() for lst in lists for t in lst), *(p.numel() for p in params))
    launches = plans.get(key) if plans is not None else None
    flags = () if found_inf is None else (found_inf,)
    if launches is None:
        device = check_tensors("adamw_step", *params, *grads, *exp_avgs, *exp_avg_sqs, *steps, grad_scale, *flags)
        launches = _launches(*lists, device)
        if plans is not None:
            while len(plans) >= MAX_PLANS:
                plans.pop(next(iter(plans)))
            plans[key] = launches
    else:
        device = params[0].device
        check_tensors("adamw_step", params[0], grad_scale, *flags)
    scale32 = grad_scale.to(device=device, dtype=torch.float32)
    skip = scale32 if found_inf is None else found_inf.to(device=device, dtype=torch.float32)
    for launch in launches:
        _adamw_tensor_list[(launch.blocks,)](
            launch.table, launch.n_tensors, scale32, skip, *launch.bases,
            lr, beta1, beta2, eps, weight_decay, math.log(beta1), math.log(beta2),
            SEARCH_STEPS=max(1, launch.n_tensors.bit_length()), BLOCK=BLOCK, P_ALIGN=launch.p_align,
            G_ALIGN=launch.g_align, N_ALIGN=launch.n_align, HAS_SKIP=found_inf is not None, num_warps=8,
        )
