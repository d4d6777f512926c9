"""Query/key RMSNorm and interleaved RoPE of a fused QKV projection (Triton), forward and backward.

Contracts: ``loongforge.core.kernels.qk_norm_rope``. A program holds ``BLOCK_M`` whole rows of
the query or the key columns (the norm spans the model width), split into channel pairs in
registers. The forward reads each row once and writes it rotated. The backward reads the
attention's gradient of a row and the row itself once, recomputes the row's statistic, and
writes the norm's input gradient straight into its columns of the QKV projection's gradient
(a third group of programs copies the values' gradient in beside it), so no concatenation
follows. The norm weights' gradients are column sums over tokens: each backward program keeps
its running sums in registers and writes one partial row, summed by torch afterwards.

Both are ``torch.library`` custom ops, so compiled graphs call them as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.qk_norm_rope import check_qkv
from loongforge.kernels.launch import check_tensors, persistent_programs, row_block

# rows per program and warps (forward, backward), and backward programs per SM slot
FORWARD_ROWS = 2
FORWARD_WARPS = 4
BACKWARD_ROWS = 1
BACKWARD_WARPS = 4
PROGRAMS_PER_SLOT = 2


@triton.jit
def _pairs(ptr, rows, row_stride, head_stride, pairs, pairs_per_head, mask):
    """fp32 ``(even, odd)`` channels ``[BLOCK_M, BLOCK_P]`` of rows laid out ``[token, head, head_dim]``."""
    head = pairs // pairs_per_head
    within = 2 * (pairs % pairs_per_head)
    offsets = rows.to(tl.int64)[:, None] * row_stride + (head * head_stride + within)[None, :]
    both = tl.join(offsets, offsets + 1)  # [BLOCK_M, BLOCK_P, 2]
    values = tl.load(ptr + both, mask=mask[:, :, None], other=0.0).to(tl.float32)
    return tl.split(values)


@triton.jit
def _weight_pairs(W, pairs, half):
    """fp32 ``(even, odd)`` entries ``[BLOCK_P]`` of a norm weight."""
    ok = pairs < half
    return tl.split(tl.load(W + tl.join(2 * pairs, 2 * pairs + 1), mask=tl.join(ok, ok), other=0.0).to(tl.float32))


@triton.jit
def _angles(COS, SIN, rows, stride_cos, stride_sin, pairs, pairs_per_head, mask):
    col = (pairs % pairs_per_head)[None, :]
    r = rows.to(tl.int64)[:, None]
    c = tl.load(COS + r * stride_cos + col, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + r * stride_sin + col, mask=mask, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _qk_norm_rope_fwd(
    QKV, W, COS, SIN, Q, K,
    n_rows, width, pairs_per_head, stride_qkv, stride_cos, stride_sin, eps,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    is_k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.arange(0, BLOCK_P)
    half = width // 2
    mask = (rows[:, None] < n_rows) & (pairs[None, :] < half)
    a, b = _pairs(QKV + is_k * width, rows, stride_qkv, 2 * pairs_per_head, pairs, pairs_per_head, mask)
    rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / width + eps)[:, None]
    w_a, w_b = _weight_pairs(W + is_k * width, pairs, half)
    out_ty = Q.dtype.element_ty
    # the norm's output is rounded to the input dtype before the rotation, as the ops composed do
    a = (a * rstd * w_a[None, :]).to(out_ty).to(tl.float32)
    b = (b * rstd * w_b[None, :]).to(out_ty).to(tl.float32)
    c, s = _angles(COS, SIN, rows, stride_cos, stride_sin, pairs, pairs_per_head, mask)
    out = tl.join(a * c - b * s, a * s + b * c).to(out_ty)
    offsets = rows.to(tl.int64)[:, None] * width + 2 * pairs[None, :]
    offsets = tl.join(offsets, offsets + 1)
    if is_k == 0:
        tl.store(Q + offsets, out, mask=mask[:, :, None])
    else:
        tl.store(K + offsets, out, mask=mask[:, :, None])


@triton.jit
def _qk_norm_rope_bwd(
    DQ, DK, DV, QKV, W, COS, SIN, DQKV, PARTIAL,
    n_rows, width, pairs_per_head, rows_per_program,
    stride_dq, stride_dq_head, stride_dk, stride_dk_head, stride_dv, stride_dv_head,
    stride_qkv, stride_cos, stride_sin, stride_dqkv, eps,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    which = tl.program_id(1)  # 0: queries, 1: keys, 2: values (a copy)
    first = tl.program_id(0) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    pairs = tl.arange(0, BLOCK_P)
    half = width // 2
    pair_ok = pairs < half
    head_dim = 2 * pairs_per_head
    out_offsets = which * width + 2 * pairs
    if which == 2:
        for start in range(first, last, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            mask = (rows[:, None] < last) & pair_ok[None, :]
            a, b = _pairs(DV, rows, stride_dv, stride_dv_head, pairs, pairs_per_head, mask)
            offsets = rows.to(tl.int64)[:, None] * stride_dqkv + out_offsets[None, :]
            tl.store(DQKV + tl.join(offsets, offsets + 1), tl.join(a, b).to(DQKV.dtype.element_ty), mask=mask[:, :, None])
    else:
        w_a, w_b = _weight_pairs(W + which * width, pairs, half)
        sum_a = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        sum_b = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        in_ty = QKV.dtype.element_ty
        for start in range(first, last, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            mask = (rows[:, None] < last) & pair_ok[None, :]
            if which == 0:
                da, db = _pairs(DQ, rows, stride_dq, stride_dq_head, pairs, pairs_per_head, mask)
            else:
                da, db = _pairs(DK, rows, stride_dk, stride_dk_head, pairs, pairs_per_head, mask)
            c, s = _angles(COS, SIN, rows, stride_cos, stride_sin, pairs, pairs_per_head, mask)
            # the rotation's gradient is rounded to the input dtype before the norm's backward
            dy_a = (da * c + db * s).to(in_ty).to(tl.float32)
            dy_b = (db * c - da * s).to(in_ty).to(tl.float32)
            x_a, x_b = _pairs(QKV + which * width, rows, stride_qkv, head_dim, pairs, pairs_per_head, mask)
            rstd = tl.rsqrt((tl.sum(x_a * x_a, axis=1) + tl.sum(x_b * x_b, axis=1)) / width + eps)[:, None]
            xhat_a, xhat_b = x_a * rstd, x_b * rstd
            g_a, g_b = dy_a * w_a[None, :], dy_b * w_b[None, :]
            mean = ((tl.sum(g_a * xhat_a, axis=1) + tl.sum(g_b * xhat_b, axis=1)) / width)[:, None]
            dx = tl.join((g_a - xhat_a * mean) * rstd, (g_b - xhat_b * mean) * rstd)
            offsets = rows.to(tl.int64)[:, None] * stride_dqkv + out_offsets[None, :]
            tl.store(DQKV + tl.join(offsets, offsets + 1), dx.to(DQKV.dtype.element_ty), mask=mask[:, :, None])
            sum_a += dy_a * xhat_a
            sum_b += dy_b * xhat_b
        partial = PARTIAL + (tl.program_id(0) * 2 + which) * width
        tl.store(partial + tl.join(2 * pairs, 2 * pairs + 1), tl.join(tl.sum(sum_a, axis=0), tl.sum(sum_b, axis=0)),
                 mask=tl.join(pair_ok, pair_ok))


def _checked(op: str, qkv, q_weight, k_weight, cos, sin) -> tuple[int, int, int]:
    """``(tokens, width, pairs per head)`` of inputs the kernels can take."""
    tokens, width = check_qkv(op, qkv, q_weight, k_weight, cos, sin)
    check_tensors(op, qkv, q_weight, k_weight, cos, sin)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"{op}: qkv, cos and sin need contiguous rows (strides {qkv.stride()}, {cos.stride()}, {sin.stride()})")
    row_block(op, width // 2)
    return tokens, width, cos.shape[1]


def _stacked(q_weight: torch.Tensor, k_weight: torch.Tensor) -> torch.Tensor:
    """Both norm weights as one fp32 ``[2, width]`` tensor (the kernels pick a row by program)."""
    return torch.stack((q_weight, k_weight)).float()


def _heads_view(op: str, name: str, t: torch.Tensor, tokens: int, width: int, head_dim: int) -> torch.Tensor:
    """``t`` (``[tokens, width]`` or ``[tokens, heads, head_dim]``) as ``[tokens, heads, head_dim]``
    with unit last stride, without a copy when its strides allow."""
    if t.numel() != tokens * width or t.shape[0] != tokens:
        raise ValueError(f"{op}: {name} must hold [tokens={tokens}, width={width}], got shape {tuple(t.shape)}")
    t3 = t.view(tokens, width // head_dim, head_dim) if t.dim() == 2 else t
    if t3.dim() != 3 or t3.shape[2] != head_dim:
        raise ValueError(f"{op}: {name} must be [tokens, heads, {head_dim}], got shape {tuple(t.shape)}")
    return t3 if t3.stride(2) == 1 else t3.contiguous()


@torch.library.custom_op("loongforge::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, k)`` ``[tokens, width]``: the query and key columns of ``qkv`` RMS-normalised and rotated."""
    tokens, width, pairs_per_head = _checked("qk_norm_rope", qkv, q_weight, k_weight, cos, sin)
    q, k = (qkv.new_empty(tokens, width) for _ in range(2))
    if tokens:
        _qk_norm_rope_fwd[(triton.cdiv(tokens, FORWARD_ROWS), 2)](
            qkv, _stacked(q_weight, k_weight), cos, sin, q, k,
            tokens, width, pairs_per_head, qkv.stride(0), cos.stride(0), sin.stride(0), eps,
            BLOCK_M=FORWARD_ROWS, BLOCK_P=triton.next_power_of_2(width // 2), num_warps=FORWARD_WARPS,
        )
    return q, k


@qk_norm_rope.register_fake
def _(qkv, q_weight, k_weight, cos, sin, eps):
    tokens, width = check_qkv("qk_norm_rope", qkv, q_weight, k_weight, cos, sin)
    return qkv.new_empty(tokens, width), qkv.new_empty(tokens, width)


@torch.library.custom_op("loongforge::qk_norm_rope_backward", mutates_args=())
def qk_norm_rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d qkv [tokens, 3 * width], [d q_weight, d k_weight] fp32)`` from the gradients of ``q``,
    ``k`` and the values (``[tokens, width]`` or ``[tokens, heads, head_dim]``, any token/head strides)."""
    op = "qk_norm_rope_backward"
    tokens, width, pairs_per_head = _checked(op, qkv, q_weight, k_weight, cos, sin)
    check_tensors(op, dq, dk, dv, qkv)
    head_dim = 2 * pairs_per_head
    dq3, dk3, dv3 = (_heads_view(op, name, t, tokens, width, head_dim) for name, t in (("dq", dq), ("dk", dk), ("dv", dv)))
    dqkv = dq.new_empty(tokens, 3 * width)
    groups = max(1, min(triton.cdiv(tokens, BACKWARD_ROWS), PROGRAMS_PER_SLOT * persistent_programs(qkv.device, tokens)))
    rows_per_program = triton.cdiv(triton.cdiv(tokens, groups), BACKWARD_ROWS) * BACKWARD_ROWS
    groups = max(1, triton.cdiv(tokens, rows_per_program))
    partial = torch.zeros(groups, 2, width, device=qkv.device, dtype=torch.float32)
    if tokens:
        _qk_norm_rope_bwd[(groups, 3)](
            dq3, dk3, dv3, qkv, _stacked(q_weight, k_weight), cos, sin, dqkv, partial,
            tokens, width, pairs_per_head, rows_per_program,
            dq3.stride(0), dq3.stride(1), dk3.stride(0), dk3.stride(1), dv3.stride(0), dv3.stride(1),
            qkv.stride(0), cos.stride(0), sin.stride(0), dqkv.stride(0), eps,
            BLOCK_M=BACKWARD_ROWS, BLOCK_P=triton.next_power_of_2(width // 2), num_warps=BACKWARD_WARPS,
        )
    return dqkv, partial.sum(0)


@qk_norm_rope_backward.register_fake
def _(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps):
    tokens, width = check_qkv("qk_norm_rope_backward", qkv, q_weight, k_weight, cos, sin)
    return dq.new_empty(tokens, 3 * width), qkv.new_empty(2, width, dtype=torch.float32)
