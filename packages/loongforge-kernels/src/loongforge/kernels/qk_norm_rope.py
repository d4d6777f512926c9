"""Query/key RMSNorm and interleaved RoPE of a fused QKV projection (Triton), forward and backward.

Contracts: ``qk_norm_rope`` and its backward (loongforge-diffusion's
``loongforge.diffusion.ops.qk_norm_rope``). A program holds ``BLOCK_M`` whole rows of
the query or the key columns (the norm spans the model width), read as contiguous blocks and
split into channel pairs in registers. The forward reads each row once and writes it rotated.
The backward reads the attention's gradient of a row and the row itself once, recomputes the
row's statistic, and writes the norm's input gradient straight into its columns of the QKV
projection's gradient (a third group of programs copies the values' gradient in beside it), so
no concatenation follows. The norm weights' gradients are column sums over tokens: each backward
program keeps its running sums in registers and writes one partial row, summed by torch
afterwards.

Both are ``torch.library`` custom ops, so compiled graphs call them as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.shapes import check_shapes
from loongforge.kernels.launch import check_tensors, row_block, split_rows, warps_for

# rows per program (forward, backward) and backward programs per SM slot; warps follow the tile
FORWARD_ROWS = 2
BACKWARD_ROWS = 1
PROGRAMS_PER_SLOT = 2


@triton.jit
def _load_rows(ptr, rows, row_stride, cols, mask):
    """fp32 ``[BLOCK_M, 2 * BLOCK_P]`` block of rows (contiguous within a row)."""
    return tl.load(ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pairs(block, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """``(even, odd)`` channels ``[BLOCK_M, BLOCK_P]`` of a ``[BLOCK_M, 2 * BLOCK_P]`` block."""
    return tl.split(tl.reshape(block, (BLOCK_M, BLOCK_P, 2)))


@triton.jit
def _interleave(even, odd, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    return tl.reshape(tl.join(even, odd), (BLOCK_M, 2 * BLOCK_P))


@triton.jit
def _weight_pairs(W, cols, width, BLOCK_P: tl.constexpr):
    """fp32 ``(even, odd)`` entries ``[1, BLOCK_P]`` of a norm weight."""
    w = tl.load(W + cols, mask=cols < width, other=0.0).to(tl.float32)
    return _pairs(w[None, :], 1, BLOCK_P)


@triton.jit
def _angles(COS, SIN, rows, stride_cos, stride_sin, pairs, pairs_per_head, mask):
    """``cos``/``sin`` ``[BLOCK_M, BLOCK_P]`` of each channel pair (``pairs_per_head`` angles a row)."""
    col = (pairs % pairs_per_head)[None, :]
    r = rows.to(tl.int64)[:, None]
    c = tl.load(COS + r * stride_cos + col, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + r * stride_sin + col, mask=mask, other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _qk_norm_rope_fwd(
    QKV, WQ, WK, COS, SIN, Q, K,
    n_rows, width, pairs_per_head, stride_qkv, stride_cos, stride_sin, eps,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    is_k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, 2 * BLOCK_P)
    pairs = tl.arange(0, BLOCK_P)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < width)[None, :]
    x = _load_rows(QKV + is_k * width, rows, stride_qkv, cols, mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)[:, None]
    if is_k == 0:
        w_a, w_b = _weight_pairs(WQ, cols, width, BLOCK_P)
    else:
        w_a, w_b = _weight_pairs(WK, cols, width, BLOCK_P)
    a, b = _pairs(x * rstd, BLOCK_M, BLOCK_P)
    out_ty = Q.dtype.element_ty
    # the norm's output is rounded to the input dtype before the rotation, as the ops composed do
    a = (a * w_a).to(out_ty).to(tl.float32)
    b = (b * w_b).to(out_ty).to(tl.float32)
    c, s = _angles(COS, SIN, rows, stride_cos, stride_sin, pairs, pairs_per_head, row_ok[:, None] & (pairs < width // 2)[None, :])
    out = _interleave(a * c - b * s, a * s + b * c, BLOCK_M, BLOCK_P).to(out_ty)
    offsets = rows.to(tl.int64)[:, None] * width + cols[None, :]
    if is_k == 0:
        tl.store(Q + offsets, out, mask=mask)
    else:
        tl.store(K + offsets, out, mask=mask)


@triton.jit
def _qk_norm_rope_bwd(
    DQ, DK, DV, QKV, WQ, WK, COS, SIN, DQKV, PARTIAL,
    n_rows, width, pairs_per_head, rows_per_program,
    stride_dq, stride_dk, stride_dv, stride_qkv, stride_cos, stride_sin, stride_dqkv, eps,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
):
    which = tl.program_id(1)  # 0: queries, 1: keys, 2: values (a copy)
    first = tl.program_id(0) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, 2 * BLOCK_P)
    pairs = tl.arange(0, BLOCK_P)
    col_ok = cols < width
    pair_ok = pairs < width // 2
    out = DQKV + which * width + cols[None, :]
    if which == 2:
        for start in range(first, last, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            mask = (rows < last)[:, None] & col_ok[None, :]
            dv = tl.load(DV + rows.to(tl.int64)[:, None] * stride_dv + cols[None, :], mask=mask)
            tl.store(out + rows.to(tl.int64)[:, None] * stride_dqkv, dv.to(DQKV.dtype.element_ty), mask=mask)
    else:
        if which == 0:
            w_a, w_b = _weight_pairs(WQ, cols, width, BLOCK_P)
        else:
            w_a, w_b = _weight_pairs(WK, cols, width, BLOCK_P)
        sum_a = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        sum_b = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        in_ty = QKV.dtype.element_ty
        for start in range(first, last, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < last
            mask = row_ok[:, None] & col_ok[None, :]
            if which == 0:
                d_out = _load_rows(DQ, rows, stride_dq, cols, mask)
            else:
                d_out = _load_rows(DK, rows, stride_dk, cols, mask)
            da, db = _pairs(d_out, BLOCK_M, BLOCK_P)
            c, s = _angles(COS, SIN, rows, stride_cos, stride_sin, pairs, pairs_per_head, row_ok[:, None] & pair_ok[None, :])
            # the rotation's gradient is rounded to the input dtype before the norm's backward
            dy_a = (da * c + db * s).to(in_ty).to(tl.float32)
            dy_b = (db * c - da * s).to(in_ty).to(tl.float32)
            x = _load_rows(QKV + which * width, rows, stride_qkv, cols, mask)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)[:, None]
            x_a, x_b = _pairs(x * rstd, BLOCK_M, BLOCK_P)
            g_a, g_b = dy_a * w_a, dy_b * w_b
            mean = ((tl.sum(g_a * x_a, axis=1) + tl.sum(g_b * x_b, axis=1)) / width)[:, None]
            dx = _interleave((g_a - x_a * mean) * rstd, (g_b - x_b * mean) * rstd, BLOCK_M, BLOCK_P)
            tl.store(out + rows.to(tl.int64)[:, None] * stride_dqkv, dx.to(DQKV.dtype.element_ty), mask=mask)
            sum_a += dy_a * x_a
            sum_b += dy_b * x_b
        partial = _interleave(tl.sum(sum_a, axis=0)[None, :], tl.sum(sum_b, axis=0)[None, :], 1, BLOCK_P)
        tl.store(PARTIAL + (tl.program_id(0) * 2 + which) * width + cols[None, :], partial, mask=col_ok[None, :])


def _dims(op: str, qkv, q_weight, k_weight, cos, sin) -> tuple[int, int, int]:
    """``(tokens, width, pairs per head)`` of valid inputs; a clear error naming the bad one otherwise."""
    dims = check_shapes(op, qkv=(qkv, "tokens qkv"), q_weight=(q_weight, "width"), k_weight=(k_weight, "width"),
                        cos=(cos, "tokens pairs"), sin=(sin, "tokens pairs"))
    width, pairs = dims["width"], dims["pairs"]
    if dims["qkv"] != 3 * width or pairs == 0 or width % (2 * pairs):
        raise ValueError(f"{op}: expected qkv [tokens, 3 * width] for norm weights [width={width}] and heads of "
                         f"2 * {pairs} channels (cos and sin [tokens, {pairs}]); got qkv {tuple(qkv.shape)}")
    return dims["tokens"], width, pairs


def _checked(op: str, qkv, q_weight, k_weight, cos, sin) -> tuple[int, int, int, int]:
    """``(tokens, width, pairs per head, pair block)`` of inputs the kernels can take."""
    tokens, width, pairs = _dims(op, qkv, q_weight, k_weight, cos, sin)
    check_tensors(op, qkv, q_weight, k_weight, cos, sin)
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"{op}: qkv, cos and sin need contiguous rows (strides {qkv.stride()}, {cos.stride()}, {sin.stride()})")
    return tokens, width, pairs, row_block(op, width) // 2


def _rows(op: str, name: str, t: torch.Tensor, tokens: int, width: int) -> torch.Tensor:
    """``t`` (``[tokens, width]`` or ``[tokens, heads, head_dim]``) as ``[tokens, width]`` rows with
    unit last stride (a copy only when its strides need one)."""
    if t.shape[0] != tokens or t.numel() != tokens * width:
        raise ValueError(f"{op}: {name} must hold [tokens={tokens}, width={width}], got shape {tuple(t.shape)}")
    rows = t.reshape(tokens, width)
    return rows if rows.stride(1) == 1 else rows.contiguous()


@torch.library.custom_op("loongforge::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, k)`` ``[tokens, width]``: the query and key columns of ``qkv`` RMS-normalised and rotated."""
    tokens, width, pairs_per_head, block_p = _checked("qk_norm_rope", qkv, q_weight, k_weight, cos, sin)
    q, k = (qkv.new_empty(tokens, width) for _ in range(2))
    if tokens:
        _qk_norm_rope_fwd[(triton.cdiv(tokens, FORWARD_ROWS), 2)](
            qkv, q_weight, k_weight, cos, sin, q, k,
            tokens, width, pairs_per_head, qkv.stride(0), cos.stride(0), sin.stride(0), eps,
            BLOCK_M=FORWARD_ROWS, BLOCK_P=block_p, num_warps=warps_for(2 * FORWARD_ROWS * block_p),
        )
    return q, k


@qk_norm_rope.register_fake
def _(qkv, q_weight, k_weight, cos, sin, eps):
    tokens, width, _ = _dims("qk_norm_rope", qkv, q_weight, k_weight, cos, sin)
    return qkv.new_empty(tokens, width), qkv.new_empty(tokens, width)


@torch.library.custom_op("loongforge::qk_norm_rope_backward", mutates_args=())
def qk_norm_rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d qkv [tokens, 3 * width], [d q_weight, d k_weight] fp32)`` from the gradients of ``q``,
    ``k`` and the values (``[tokens, width]`` or ``[tokens, heads, head_dim]``)."""
    op = "qk_norm_rope_backward"
    tokens, width, pairs_per_head, block_p = _checked(op, qkv, q_weight, k_weight, cos, sin)
    check_tensors(op, dq, dk, dv, qkv)
    dq2, dk2, dv2 = (_rows(op, name, t, tokens, width) for name, t in (("dq", dq), ("dk", dk), ("dv", dv)))
    dqkv = dq.new_empty(tokens, 3 * width)
    groups, rows_per_program = split_rows(qkv.device, tokens, BACKWARD_ROWS, PROGRAMS_PER_SLOT)
    partial = torch.zeros(groups, 2, width, device=qkv.device, dtype=torch.float32)
    if tokens:
        _qk_norm_rope_bwd[(groups, 3)](
            dq2, dk2, dv2, qkv, q_weight, k_weight, cos, sin, dqkv, partial,
            tokens, width, pairs_per_head, rows_per_program,
            dq2.stride(0), dk2.stride(0), dv2.stride(0), qkv.stride(0), cos.stride(0), sin.stride(0), dqkv.stride(0), eps,
            BLOCK_M=BACKWARD_ROWS, BLOCK_P=block_p, num_warps=warps_for(2 * BACKWARD_ROWS * block_p),
        )
    return dqkv, partial.sum(0)


@qk_norm_rope_backward.register_fake
def _(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, eps):
    tokens, width, _ = _dims("qk_norm_rope_backward", qkv, q_weight, k_weight, cos, sin)
    return dq.new_empty(tokens, 3 * width), qkv.new_empty(2, width, dtype=torch.float32)
