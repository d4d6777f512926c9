"""adaLN's LayerNorm with an affine transform per sample (Triton), forward and backward.

Contracts: ``loongforge.diffusion.ops.layer_norm``. A program holds ``BLOCK_M`` whole rows (the
statistics span the width). The forward reads each row once, looks its transform row up (the
shared one, or its sample's through ``index``) and writes it normalised and transformed. The
backward reads a row and its output gradient once, recomputes the row's statistics and writes
``dx``; the transform's gradients are sums over each sample's tokens: a program walks its rows in
order, keeps the running sums of the current sample in registers and adds them to its own
partial row of that sample whenever the sample changes (tokens of a sample are contiguous in a
pack, so that is at most once per sample it touches); torch sums the partials afterwards, so
the result does not depend on scheduling. The partial rows are ``[programs, samples, width]``
fp32, zeroed and summed on every call: negligible for a video or a pack of a few, but for packs
of tens of samples (many small images) they cost as much traffic as the kernel itself; a
layout indexed by ``program + sample`` (unique when a pack's samples are contiguous and in
order) would bring it back to ``programs + samples`` rows.

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
def _normalized(X, rows, stride_x, cols, mask, width, eps):
    """fp32 ``((x - mean) * rstd, rstd)`` of a ``[BLOCK_M, BLOCK_N]`` block of rows (zero outside ``mask``)."""
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    centered = tl.where(mask, x - (tl.sum(x, axis=1) / width)[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / width + eps)[:, None]
    return centered * rstd, rstd


@triton.jit
def _modulated_ln_fwd(
    X, W, B, INDEX, Y, n_rows, width, stride_x, stride_w, stride_b, stride_y, eps,
    HAS_INDEX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < width)[None, :]
    xhat, _ = _normalized(X, rows, stride_x, cols, mask, width, eps)
    if HAS_INDEX:
        sample = tl.load(INDEX + rows, mask=row_ok, other=0)[:, None]
    else:
        sample = tl.zeros([BLOCK_M, 1], dtype=tl.int64)
    w = tl.load(W + sample * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + sample * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = xhat * w + b
    tl.store(Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_partial(PARTIAL_W, PARTIAL_B, slot, cols, col_ok, sum_w, sum_b):
    """Add a sample's running sums (``[BLOCK_M, BLOCK_N]``) to this program's partial rows of it."""
    pw = PARTIAL_W + slot + cols
    pb = PARTIAL_B + slot + cols
    tl.store(pw, tl.load(pw, mask=col_ok, other=0.0) + tl.sum(sum_w, axis=0), mask=col_ok)
    tl.store(pb, tl.load(pb, mask=col_ok, other=0.0) + tl.sum(sum_b, axis=0), mask=col_ok)


@triton.jit
def _modulated_ln_bwd(
    DY, X, W, INDEX, DX, PARTIAL_W, PARTIAL_B, n_rows, width, n_samples, rows_per_program,
    stride_dy, stride_x, stride_w, stride_dx, eps,
    HAS_INDEX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(not HAS_INDEX or BLOCK_M == 1, "with an index the sample can change at every row: BLOCK_M must be 1")
    pid = tl.program_id(0)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < width
    if HAS_INDEX:
        current = tl.load(INDEX + first).to(tl.int64)
    else:
        current = tl.full([], 0, tl.int64)
    w = tl.load(W + current * stride_w + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sum_w = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sum_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(first, last, BLOCK_M):
        if HAS_INDEX:
            sample = tl.load(INDEX + start).to(tl.int64)
            if sample != current:
                _add_partial(PARTIAL_W, PARTIAL_B, (pid * n_samples + current) * width, cols, col_ok, sum_w, sum_b)
                sum_w = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                sum_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                current = sample
                w = tl.load(W + current * stride_w + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & col_ok[None, :]
        row_offsets = rows.to(tl.int64)[:, None]
        dy = tl.load(DY + row_offsets * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xhat, rstd = _normalized(X, rows, stride_x, cols, mask, width, eps)
        g = dy * w
        mean_g = (tl.sum(g, axis=1) / width)[:, None]
        mean_gx = (tl.sum(g * xhat, axis=1) / width)[:, None]
        dx = rstd * (g - mean_g - xhat * mean_gx)
        tl.store(DX + row_offsets * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        sum_w += dy * xhat
        sum_b += dy
    _add_partial(PARTIAL_W, PARTIAL_B, (pid * n_samples + current) * width, cols, col_ok, sum_w, sum_b)


def check_layer_norm(op: str, x, weight, bias, index) -> tuple[int, int]:
    """``(tokens, width)`` of inputs of the contract (x ``[T, W]``, weight and bias ``[R, W]``, index
    int64 ``[T]`` or None with one row)."""
    index_shape = {} if index is None else {"index": (index, "T")}
    sizes = check_shapes(op, x=(x, "T W"), weight=(weight, "R W"), bias=(bias, "R W"), **index_shape)
    if index is None and sizes["R"] != 1:
        raise ValueError(f"{op}: a transform of {sizes['R']} rows needs an index (the row of each token)")
    if index is not None and index.dtype != torch.int64:
        raise ValueError(f"{op}: index must be int64, got {index.dtype}")
    return sizes["T"], sizes["W"]


def _checked(op: str, x, weight, bias, index) -> tuple[int, int, int]:
    """``(tokens, width, column block)`` of inputs the kernels can take."""
    tokens, width = check_layer_norm(op, x, weight, bias, index)
    check_tensors(op, x, weight, bias, *(() if index is None else (index,)))
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t.stride(1) != 1:
            raise ValueError(f"{op}: {name} needs contiguous rows (strides {t.stride()})")
    return tokens, width, row_block(op, width)


@torch.library.custom_op("loongforge::modulated_layer_norm", mutates_args=())
def modulated_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, index: torch.Tensor | None = None
) -> torch.Tensor:
    """``layer_norm(x) * weight[index] + bias[index]`` ``[tokens, width]`` in ``x``'s dtype (fp32 math)."""
    tokens, width, block_n = _checked("modulated_layer_norm", x, weight, bias, index)
    y = x.new_empty(tokens, width)
    if tokens:
        index = index.contiguous() if index is not None else None
        _modulated_ln_fwd[(triton.cdiv(tokens, FORWARD_ROWS),)](
            x, weight, bias, index if index is not None else x, y, tokens, width,
            x.stride(0), weight.stride(0), bias.stride(0), y.stride(0), eps,
            HAS_INDEX=index is not None, BLOCK_M=FORWARD_ROWS, BLOCK_N=block_n, num_warps=warps_for(FORWARD_ROWS * block_n),
        )
    return y


@modulated_layer_norm.register_fake
def _(x, weight, bias, eps, index=None):
    tokens, width = check_layer_norm("modulated_layer_norm", x, weight, bias, index)
    return x.new_empty(tokens, width)


@torch.library.custom_op("loongforge::modulated_layer_norm_backward", mutates_args=())
def modulated_layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)``: ``dx`` in ``x``'s dtype, the transform's gradients fp32
    ``[rows, width]`` (each row summed over its tokens)."""
    op = "modulated_layer_norm_backward"
    tokens, width, block_n = _checked(op, x, weight, bias, index)
    check_tensors(op, dy, x)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy shape {tuple(dy.shape)} != x shape {tuple(x.shape)}")
    dy = dy if dy.stride(1) == 1 else dy.contiguous()
    dx = x.new_empty(tokens, width)
    block_m = 1 if index is not None else BACKWARD_ROWS
    groups, rows_per_program = split_rows(x.device, tokens, block_m, PROGRAMS_PER_SLOT)
    samples = weight.shape[0]
    partial_w, partial_b = (torch.zeros(groups, samples, width, device=x.device, dtype=torch.float32) for _ in range(2))
    if tokens:
        index = index.contiguous() if index is not None else None
        _modulated_ln_bwd[(groups,)](
            dy, x, weight, index if index is not None else x, dx, partial_w, partial_b,
            tokens, width, samples, rows_per_program, dy.stride(0), x.stride(0), weight.stride(0), dx.stride(0), eps,
            HAS_INDEX=index is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps_for(block_m * block_n),
        )
    return dx, partial_w.sum(0), partial_b.sum(0)


@modulated_layer_norm_backward.register_fake
def _(dy, x, weight, bias, eps, index=None):
    tokens, width = check_layer_norm("modulated_layer_norm_backward", x, weight, bias, index)
    return (x.new_empty(tokens, width), x.new_empty(weight.shape, dtype=torch.float32),
            x.new_empty(weight.shape, dtype=torch.float32))
