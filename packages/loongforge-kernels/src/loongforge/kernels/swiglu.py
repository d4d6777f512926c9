"""Fused SwiGLU on megatron's concatenated ``[gate, up]`` layout (Triton), forward and backward.

Contract: ``loongforge.core.kernels.reference.swiglu`` and ``swiglu_backward``. Math is fp32 in
registers, rounded once to the input dtype. The backward writes ``d(gate_up)`` in the same
concatenated layout and, on request, the output ``silu(gate) * up`` recomputed in the same pass
(``swiglu_backward(..., with_output=True)``: a layer that did not keep the output gets it for the
next linear's weight gradient without reading ``gate_up`` a second time).
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
def _swiglu_bwd(DY, GU, DGU, Y, n_cols, stride_dy, stride_gu, stride_dgu, stride_y, BLOCK: tl.constexpr,
                WRITE_Y: tl.constexpr):
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
    if WRITE_Y:
        tl.store(Y + row * stride_y + cols, (silu * up).to(Y.dtype.element_ty), mask=mask)


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
        return _backward(dy, gu, False)[0].view(ctx.shape)


def _backward(dy: torch.Tensor, gu: torch.Tensor, with_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d(gate_up), y or an empty tensor)`` over ``[rows, 2 * n]`` ``gu``."""
    dy2 = _rows(dy)
    n_cols = gu.shape[1] // 2
    dgu = torch.empty(gu.shape, dtype=gu.dtype, device=gu.device)
    y = torch.empty((gu.shape[0], n_cols) if with_output else (0,), dtype=gu.dtype, device=gu.device)
    if dgu.numel():
        _swiglu_bwd[_grid(gu.shape[0], n_cols)](
            dy2, gu, dgu, y, n_cols, dy2.stride(0), gu.stride(0), dgu.stride(0), y.stride(0) if with_output else 0,
            BLOCK=BLOCK_COLS, WRITE_Y=with_output,
        )
    return dgu, y


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused ``loongforge.core.kernels.reference.swiglu``: ``silu(gate) * up``."""
    return _SwiGLU.apply(gate_up)


def swiglu_backward(dy: torch.Tensor, gate_up: torch.Tensor, with_output: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``loongforge.core.kernels.reference.swiglu_backward``: ``(d(gate_up), swiglu(gate_up) or
    an empty tensor)`` in one pass over ``gate_up``."""
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2 or dy.shape != (*gate_up.shape[:-1], gate_up.shape[-1] // 2):
        raise ValueError(f"swiglu_backward: dy {tuple(dy.shape)} does not match gate_up {tuple(gate_up.shape)} "
                         "(cat([gate, up], -1); dy has half its last dim)")
    check_tensors("swiglu_backward", dy, gate_up)
    dgu, y = _backward(dy, _rows(gate_up), with_output)
    shape = gate_up.shape
    return dgu.view(shape), y.view(*shape[:-1], shape[-1] // 2) if with_output else y
