"""FP8 cast-transpose: one pass over a matrix writes its tensor-scaled e4m3/e5m2 copy and the
transposed copy that Hopper's FP8 GEMMs need for the weight gradient.

Contract: ``loongforge.diffusion.ops.fp8_tensorwise.cast_transpose`` (bitwise on a GPU: the
input times the IEEE-rounded reciprocal of the scale, rounded to the nearest fp8 value, ties to
even, as torch's).

It is a ``torch.library`` custom op (``loongforge::fp8_cast_transpose``), so ``torch.compile``
calls the kernel as it is instead of tracing into it; inductor still fuses the amax reduction
that makes the scale with the producer of the input. A bf16/fp16 tile is read once and stored
twice, the second time through ``tl.trans``, so both copies are written row by row; an fp32 tile
(master weights) is read a second time in column order for the transposed copy (below).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.fp8_format import fp8_dtype, padded_rows
from loongforge.kernels.launch import check_tensors
from loongforge.kernels.tanh_gelu import gelu_tanh

# 64x64 tiles, 4 warps: the fastest of ten tilings at a Wan-1.3B block's shapes on an H200
# (14040 x 1536 and 14040 x 8960 bf16, 8960 x 1536 fp32)
BLOCK_ROWS = 64
BLOCK_COLS = 64


@triton.jit
def cast_transpose_kernel(
    X, Q, QT, S, n_rows, n_cols, n_rows_t, stride_x,
    FMAX: tl.constexpr, GELU: tl.constexpr, TRANSPOSE_BY_LOAD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Casts ``X`` (or ``gelu(X)``, with ``GELU``) times the IEEE reciprocal of the scale at ``S``
    into ``Q`` and ``QT``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if GELU:
        x = gelu_tanh(x)  # gelu(0) = 0: the padding stays zero
    inverse = tl.math.div_rn(1.0, tl.load(S))
    q = tl.clamp(x * inverse, -FMAX, FMAX).to(Q.dtype.element_ty)
    tl.store(Q + rows64[:, None] * n_cols + cols[None, :], q, mask=inside)
    # rows n_rows..n_rows_t of the transposed copy (its padding) get the zeros loaded for them
    inside_t = (cols[:, None] < n_cols) & (rows[None, :] < n_rows_t)
    if TRANSPOSE_BY_LOAD:
        # fp32 inputs (master weights): tl.trans of their tile wrote wrong bytes into some
        # transposed copies on an H200 (Triton 3.6), so the tile is read again in column order
        xt = tl.load(X + rows64[None, :] * stride_x + cols[:, None],
                     mask=(cols[:, None] < n_cols) & (rows[None, :] < n_rows), other=0.0).to(tl.float32)
        if GELU:
            xt = gelu_tanh(xt)
        q_t = tl.clamp(xt * inverse, -FMAX, FMAX).to(QT.dtype.element_ty)
    else:
        q_t = tl.trans(q)
    tl.store(QT + cols64[:, None] * n_rows_t + rows[None, :], q_t, mask=inside_t)


def out_shapes(x: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    rows, cols = x.shape
    return (rows, cols), (cols, padded_rows(rows))


def launch_cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`cast_transpose_kernel` on a matrix whose rows are contiguous: ``(q, q_t)``
    of ``x`` (or ``gelu(x)``) scaled by the fp32 scalar ``scale``, cast to ``dtype``."""
    shape, shape_t = out_shapes(x)
    q = torch.empty(shape, device=x.device, dtype=dtype)
    q_t = torch.empty(shape_t, device=x.device, dtype=dtype)
    grid = (triton.cdiv(shape_t[1], BLOCK_ROWS), triton.cdiv(shape[1], BLOCK_COLS))
    cast_transpose_kernel[grid](x, q, q_t, scale, shape[0], shape[1], shape_t[1], x.stride(0),
                                FMAX=torch.finfo(dtype).max, GELU=gelu, TRANSPOSE_BY_LOAD=x.dtype == torch.float32,
                                BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=4)
    return q, q_t


@torch.library.custom_op("loongforge::fp8_cast_transpose", mutates_args=())
def fp8_cast_transpose(x: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, C]`` -> (``q [M, C]``, ``q_t [C, M']``): ``x * (1 / scale)`` saturated and rounded to
    e5m2 (``e5m2``) or e4m3, and its transpose with ``M`` zero-padded to a multiple of 16."""
    if x.dim() != 2 or scale.numel() != 1:
        raise ValueError(f"fp8_cast_transpose: expected a matrix and a scalar scale, got {tuple(x.shape)} and {tuple(scale.shape)}")
    check_tensors("fp8_cast_transpose", x, scale)
    return launch_cast_transpose(x if x.stride(1) == 1 else x.contiguous(), scale.float(), fp8_dtype(e5m2), gelu=False)


@fp8_cast_transpose.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = fp8_dtype(e5m2)
    shape, shape_t = out_shapes(x)
    return x.new_empty(shape, dtype=dtype), x.new_empty(shape_t, dtype=dtype)
