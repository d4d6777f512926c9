"""adaLN's LayerNorm with a per-token or shared affine transform (Triton), forward and backward.

Contracts: ``loongforge.core.kernels.layer_norm``. A program holds ``BLOCK_M`` whole rows (the
statistics span the width). The forward reads each row once and writes it normalised and
transformed. The backward reads a row and its output gradient once, recomputes the row's
statistics and writes ``dx``; the transform's gradients are either per token (written row by
row) or summed over tokens, each program keeping its running sums in registers and writing one
partial row, summed by torch afterwards.

Both are ``torch.library`` custom ops, so compiled graphs call them as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.layer_norm import check_layer_norm
from loongforge.kernels.launch import check_tensors, persistent_programs, row_block, warps_for

# rows per program (forward, backward) and backward programs per SM slot; warps follow the tile
FORWARD_ROWS = 2
BACKWARD_ROWS = 1
PROGRAMS_PER_SLOT = 2


@triton.jit
def _normalized(X, rows, stride_x, cols, mask, width, eps):
    """fp32 ``((x - mean) * rstd, rstd)`` of a ``[BLOCK_M, BLOCK_N]`` block of rows (zero outside ``mask``)."""
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    centered = tl.where(mask, x - (tl.sum(x, axis=1) / width)[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / width + eps)[:, None]
    return centered * rstd, rstd


@triton.jit
def _modulated_ln_fwd(
    X, W, B, Y, n_rows, width, stride_x, stride_w, stride_b, stride_y, eps,
    PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    xhat, _ = _normalized(X, rows, stride_x, cols, mask, width, eps)
    if PER_TOKEN:
        w = tl.load(W + rows.to(tl.int64)[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + rows.to(tl.int64)[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(W + cols, mask=cols < width, other=0.0).to(tl.float32)[None, :]
        b = tl.load(B + cols, mask=cols < width, other=0.0).to(tl.float32)[None, :]
    y = xhat * w + b
    tl.store(Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _modulated_ln_bwd(
    DY, X, W, DX, DW, DB, n_rows, width, rows_per_program,
    stride_dy, stride_x, stride_w, stride_dx, eps,
    PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    first = tl.program_id(0) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < width
    if not PER_TOKEN:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        sum_w = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        sum_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & col_ok[None, :]
        row_offsets = rows.to(tl.int64)[:, None]
        dy = tl.load(DY + row_offsets * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xhat, rstd = _normalized(X, rows, stride_x, cols, mask, width, eps)
        if PER_TOKEN:
            w = tl.load(W + row_offsets * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = dy * w
        mean_g = (tl.sum(g, axis=1) / width)[:, None]
        mean_gx = (tl.sum(g * xhat, axis=1) / width)[:, None]
        dx = rstd * (g - mean_g - xhat * mean_gx)
        tl.store(DX + row_offsets * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if PER_TOKEN:  # fp32 [tokens, width] gradients, row-major
            tl.store(DW + row_offsets * width + cols[None, :], dy * xhat, mask=mask)
            tl.store(DB + row_offsets * width + cols[None, :], dy, mask=mask)
        else:
            sum_w += dy * xhat
            sum_b += dy
    if not PER_TOKEN:  # one partial row per program
        tl.store(DW + tl.program_id(0) * width + cols, tl.sum(sum_w, axis=0), mask=col_ok)
        tl.store(DB + tl.program_id(0) * width + cols, tl.sum(sum_b, axis=0), mask=col_ok)


def _checked(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[int, int, bool, int]:
    """``(tokens, width, per token, column block)`` of inputs the kernels can take."""
    tokens, width = check_layer_norm(op, x, weight, bias)
    check_tensors(op, x, weight, bias)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t.stride(1) != 1:
            raise ValueError(f"{op}: {name} needs contiguous rows (strides {t.stride()})")
    return tokens, width, weight.shape[0] != 1, row_block(op, width)


@torch.library.custom_op("loongforge::modulated_layer_norm", mutates_args=())
def modulated_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``layer_norm(x) * weight + bias`` ``[tokens, width]`` in ``x``'s dtype (fp32 math)."""
    tokens, width, per_token, block_n = _checked("modulated_layer_norm", x, weight, bias)
    y = x.new_empty(tokens, width)
    if tokens:
        _modulated_ln_fwd[(triton.cdiv(tokens, FORWARD_ROWS),)](
            x, weight, bias, y, tokens, width, x.stride(0), weight.stride(0), bias.stride(0), y.stride(0), eps,
            PER_TOKEN=per_token, BLOCK_M=FORWARD_ROWS, BLOCK_N=block_n, num_warps=warps_for(FORWARD_ROWS * block_n),
        )
    return y


@modulated_layer_norm.register_fake
def _(x, weight, bias, eps):
    tokens, width = check_layer_norm("modulated_layer_norm", x, weight, bias)
    return x.new_empty(tokens, width)


@torch.library.custom_op("loongforge::modulated_layer_norm_backward", mutates_args=())
def modulated_layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``: ``dx`` in ``x``'s dtype, the transform's gradients fp32 in its
    shape (summed over tokens when shared)."""
    op = "modulated_layer_norm_backward"
    tokens, width, per_token, block_n = _checked(op, x, weight, bias)
    check_tensors(op, dy, x)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy shape {tuple(dy.shape)} != x shape {tuple(x.shape)}")
    dy = dy if dy.stride(1) == 1 else dy.contiguous()
    dx = x.new_empty(tokens, width)
    groups = max(1, min(triton.cdiv(tokens, BACKWARD_ROWS), PROGRAMS_PER_SLOT * persistent_programs(x.device, tokens)))
    rows_per_program = triton.cdiv(triton.cdiv(tokens, groups), BACKWARD_ROWS) * BACKWARD_ROWS
    groups = max(1, triton.cdiv(tokens, rows_per_program))
    rows_out = tokens if per_token else groups
    dw, db = (torch.zeros(rows_out, width, device=x.device, dtype=torch.float32) for _ in range(2))
    if tokens:
        _modulated_ln_bwd[(groups,)](
            dy, x, weight, dx, dw, db, tokens, width, rows_per_program,
            dy.stride(0), x.stride(0), weight.stride(0), dx.stride(0), eps,
            PER_TOKEN=per_token, BLOCK_M=BACKWARD_ROWS, BLOCK_N=block_n, num_warps=warps_for(BACKWARD_ROWS * block_n),
        )
    if not per_token:
        dw, db = dw.sum(0, keepdim=True), db.sum(0, keepdim=True)
    return dx, dw, db


@modulated_layer_norm_backward.register_fake
def _(dy, x, weight, bias, eps):
    tokens, width = check_layer_norm("modulated_layer_norm_backward", x, weight, bias)
    rows = weight.shape[0]
    return x.new_empty(tokens, width), x.new_empty(rows, width, dtype=torch.float32), x.new_empty(rows, width, dtype=torch.float32)
