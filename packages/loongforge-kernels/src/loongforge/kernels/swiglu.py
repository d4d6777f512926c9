"""Fused SwiGLU on megatron's concatenated ``[gate, up]`` layout (Triton), forward and backward.

Contract: ``loongforge.core.kernels.reference.swiglu``. Math is fp32 in registers, rounded once
to the input dtype. The backward writes ``d(gate_up)`` in the same concatenated layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.kernels.launch import check_tensors

BLOCK_COLS = 1024  # columns of gate (and of up) per program


@triton.jit
def _swiglu_fwd(GU, Y, n_cols, stride_gu, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, GU, DGU, n_cols, stride_dy, stride_gu, stride_dgu, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    dgate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dy * silu
    tl.store(DGU + row * stride_dgu + cols, dgate.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * stride_dgu + n_cols + cols, dup.to(DGU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(rows: int, n_cols: int) -> tuple[int, int]:
    return rows, triton.cdiv(n_cols, BLOCK_COLS)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
            raise ValueError(f"swiglu: last dim of gate_up (shape {tuple(gate_up.shape)}) must be even: cat([gate, up], -1)")
        check_tensors("swiglu", gate_up)
        gu = _rows(gate_up)
        n_cols = gu.shape[1] // 2
        y = torch.empty((gu.shape[0], n_cols), dtype=gate_up.dtype, device=gate_up.device)
        if y.numel():
            _swiglu_fwd[_grid(gu.shape[0], n_cols)](gu, y, n_cols, gu.stride(0), y.stride(0), BLOCK=BLOCK_COLS)
        ctx.save_for_backward(gu)
        ctx.shape = gate_up.shape
        return y.view(*gate_up.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        dy2 = _rows(dy)
        n_cols = gu.shape[1] // 2
        dgu = torch.empty(gu.shape, dtype=gu.dtype, device=gu.device)
        if dgu.numel():
            _swiglu_bwd[_grid(gu.shape[0], n_cols)](
                dy2, gu, dgu, n_cols, dy2.stride(0), gu.stride(0), dgu.stride(0), BLOCK=BLOCK_COLS
            )
        return dgu.view(ctx.shape)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused ``loongforge.core.kernels.reference.swiglu``: ``silu(gate) * up``."""
    return _SwiGLU.apply(gate_up)
