"""Tanh-GELU of a feed-forward's hidden layer: one pass for its backward, and its FP8 cast
straight from the GELU's input.

Contracts: ``loongforge.diffusion.ops.gelu``. ``gelu_tanh_backward`` reads ``h`` and ``dg`` once and
writes ``dh`` (and ``gelu(h)`` on request), summing ``dh`` per column (the bias gradient) and
taking its amax on the way: each program walks a column block down a range of rows, keeps the
column sums in registers and writes one partial row (summed by torch afterwards, so the result
does not depend on scheduling). ``gelu_fp8_cast_transpose`` takes ``amax(|gelu(h)|)`` in one read
of ``h`` and then casts ``gelu(h)`` with the cast-transpose kernel's GELU prologue, so ``gelu(h)``
is never written in bf16.

Both are ``torch.library`` custom ops, so compiled graphs call them as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.fp8_format import E4M3, scale_from_amax
from loongforge.core.kernels.shapes import check_matrices
from loongforge.kernels.fp8_cast import launch_cast_transpose, out_shapes
from loongforge.kernels.launch import check_tensors, persistent_programs, split_rows
from loongforge.kernels.tanh_gelu import gelu_tanh, gelu_tanh_and_slope

# the backward's tile: 4 rows x 1024 columns, 4 warps, four programs per SM slot: the fastest of
# ten tilings x three program counts at 14040 x 8960 bf16 on an H200 (3.1-3.4 TB/s)
BLOCK_M = 4
BLOCK_N = 1024
NUM_WARPS = 4
PROGRAMS_PER_SLOT = 4
AMAX_BLOCK = 4096


@triton.jit
def _gelu_tanh_backward(
    DG, H, DH, G, PARTIAL, AMAX, n_rows, n_cols, rows_per_program,
    WITH_OUTPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    first = tl.program_id(1) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # per-element partial sums and maxima, reduced over rows once at the end
    col_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    col_max = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        inside = (rows[:, None] < last) & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        y = tl.load(H + offsets, mask=inside, other=0.0).to(tl.float32)
        dg = tl.load(DG + offsets, mask=inside, other=0.0).to(tl.float32)
        g, slope = gelu_tanh_and_slope(y)
        dh = dg * slope  # 0 outside (dg loads 0 there)
        tl.store(DH + offsets, dh.to(DH.dtype.element_ty), mask=inside)
        if WITH_OUTPUT:
            tl.store(G + offsets, g.to(G.dtype.element_ty), mask=inside)
        col_sum += dh
        col_max = tl.maximum(col_max, tl.abs(dh))
    tl.store(PARTIAL + tl.program_id(1) * n_cols + cols, tl.sum(col_sum, axis=0), mask=col_ok)
    # a NaN in dh is skipped here (the reference's amax would be NaN), but dh itself carries it on
    tl.atomic_max(AMAX, tl.max(tl.max(col_max, axis=1), axis=0))


@triton.jit
def _gelu_amax(H, AMAX, numel, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # the loop counts blocks; the element offsets advance in int64 (an int32 one would wrap near 2^31)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for _ in range(tl.program_id(0), tl.cdiv(numel, BLOCK), tl.num_programs(0)):
        y = tl.load(H + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(gelu_tanh(y)))
        offsets += step
    tl.atomic_max(AMAX, tl.max(acc, axis=0))


def _check_matrices(op: str, *tensors: torch.Tensor) -> None:
    check_matrices(op, *tensors)
    check_tensors(op, *tensors)


def _backward_outputs(dg: torch.Tensor, h: torch.Tensor, with_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``dh`` and ``gelu(h)`` (empty unless ``with_output``), row-major whatever the inputs' strides."""
    dh = dg.new_empty(dg.shape)
    return dh, h.new_empty(h.shape) if with_output else h.new_empty(0)


def _launch_backward(dg: torch.Tensor, h: torch.Tensor, dh: torch.Tensor, g: torch.Tensor | None):
    """The backward pass over row-major ``dg`` and ``h`` into ``dh`` (which may be ``dg`` itself) and,
    given, ``g``; returns ``(dh.sum(0), amax(|dh|))``, fp32."""
    n_rows, n_cols = h.shape
    n_col_blocks = triton.cdiv(n_cols, BLOCK_N)
    groups, rows_per_program = split_rows(h.device, n_rows, BLOCK_M, PROGRAMS_PER_SLOT, n_col_blocks)
    partial = torch.empty(groups, n_cols, device=h.device, dtype=torch.float32)
    amax = torch.zeros((), device=h.device, dtype=torch.float32)
    _gelu_tanh_backward[(n_col_blocks, groups)](
        dg, h, dh, g if g is not None else dh, partial, amax, n_rows, n_cols, rows_per_program,
        WITH_OUTPUT=g is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )
    return partial.sum(0), amax


@torch.library.custom_op("loongforge::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward(
    dg: torch.Tensor, h: torch.Tensor, with_output: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dh, dh.sum(0) fp32, amax(|dh|) fp32, gelu(h) or empty)`` of ``[M, N]`` matrices."""
    _check_matrices("gelu_tanh_backward", dg, h)
    dg, h = dg.contiguous(), h.contiguous()
    dh, g = _backward_outputs(dg, h, with_output)
    db, amax = _launch_backward(dg, h, dh, g if with_output else None)
    return dh, db, amax, g


@gelu_tanh_backward.register_fake
def _(dg: torch.Tensor, h: torch.Tensor, with_output: bool):
    dh, g = _backward_outputs(dg, h, with_output)
    return dh, h.new_empty(h.shape[1], dtype=torch.float32), h.new_empty((), dtype=torch.float32), g


@torch.library.custom_op("loongforge::gelu_tanh_backward_in_place", mutates_args=("dg",))
def gelu_tanh_backward_in_place(dg: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``dg`` overwritten with ``dh`` (each tile is read before it is written, by the program that
    owns it); returns ``dh.sum(0)`` fp32. A ``dg`` that is not row-major is worked on in a row-major
    copy, copied back."""
    _check_matrices("gelu_tanh_backward_in_place", dg, h)
    rows = dg.contiguous()
    db, _ = _launch_backward(rows, h.contiguous(), rows, None)
    if rows is not dg:
        dg.copy_(rows)
    return db


@gelu_tanh_backward_in_place.register_fake
def _(dg: torch.Tensor, h: torch.Tensor):
    return h.new_empty(h.shape[1], dtype=torch.float32)


@torch.library.custom_op("loongforge::gelu_fp8_cast_transpose", mutates_args=())
def gelu_fp8_cast_transpose(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [M, N], q_t [N, M'], scale)``: ``gelu(h)`` in e4m3 with its tensor-wise scale, in both layouts."""
    _check_matrices("gelu_fp8_cast_transpose", h)
    h = h.contiguous()
    amax = torch.zeros((), device=h.device, dtype=torch.float32)
    numel = h.numel()
    programs = max(1, min(triton.cdiv(numel, AMAX_BLOCK), 4 * persistent_programs(h.device, numel)))
    _gelu_amax[(programs,)](h, amax, numel, BLOCK=AMAX_BLOCK, num_warps=8)
    scale = scale_from_amax(amax, E4M3)
    return *launch_cast_transpose(h, scale, E4M3, gelu=True), scale


@gelu_fp8_cast_transpose.register_fake
def _(h: torch.Tensor):
    shape, shape_t = out_shapes(h)
    return h.new_empty(shape, dtype=E4M3), h.new_empty(shape_t, dtype=E4M3), h.new_empty((), dtype=torch.float32)
