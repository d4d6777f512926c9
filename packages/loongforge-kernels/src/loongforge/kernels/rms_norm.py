"""Fused RMSNorm, residual-add + RMSNorm and RMSNorm passing its input on (Triton), forward and
backward.

Contracts: ``loongforge.core.kernels.reference.rms_norm`` / ``add_rms_norm`` /
``rms_norm_with_residual`` (whose backward adds the passed-on input's gradient inside the norm's
pass, as ``add_rms_norm``'s adds the sum's). Statistics are fp32;
the forward saves one fp32 ``rstd`` per row so the backward never recomputes the reduction.
The weight gradient is reduced in two stages: each program accumulates the rows it owns into one
fp32 partial row, then the partials are summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.kernels.launch import check_tensors, persistent_programs, row_block, warps_for


@triton.jit
def _rms_norm_fwd(
    X, R, S, Y, W, RSTD,
    n_cols, stride_x, stride_r, stride_s, stride_y, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd) * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd(
    DY, X, W, RSTD, DS, DX, DR, DW_PARTIAL,
    n_rows, n_cols, rows_per_program,
    stride_dy, stride_x, stride_ds, stride_dx, stride_dr,
    HAS_DS: tl.constexpr, HAS_DR: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / n_cols)) * rstd
        if HAS_DS:
            dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DR:
            tl.store(DR + row * stride_dr + cols, dx.to(DR.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def _rows(op: str, t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``t`` as a ``[rows, n_cols]`` matrix whose rows are contiguous."""
    if t.shape[-1] != n_cols:
        raise ValueError(f"{op}: last dim {t.shape[-1]} of an input of shape {tuple(t.shape)} != weight size {n_cols}")
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _forward(op, x, residual, weight, eps):
    if weight.dim() != 1:
        raise ValueError(f"{op}: weight must be 1-D, got shape {tuple(weight.shape)}")
    n = weight.shape[0]
    check_tensors(op, x, weight, *(() if residual is None else (residual,)))
    block = row_block(op, n)
    x2 = _rows(op, x, n)
    weight = weight.contiguous()
    rows = x2.shape[0]
    if residual is None:
        r2 = s2 = None
        norm_dtype = x.dtype
    else:
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = _rows(op, residual, n)
        norm_dtype = torch.result_type(x, residual)
        s2 = torch.empty((rows, n), dtype=norm_dtype, device=x.device)
    y2 = torch.empty((rows, n), dtype=norm_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_fwd[(rows,)](
            x2, r2 if r2 is not None else x2, s2 if s2 is not None else y2, y2, weight, rstd,
            n, x2.stride(0), r2.stride(0) if r2 is not None else 0, s2.stride(0) if s2 is not None else 0,
            y2.stride(0), eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps_for(block),
        )
    return x2, y2, s2, rstd


def _backward(op, dy, normed_input, weight, rstd, ds, dx_dtype, dr_dtype):
    """Gradients of ``rms_norm(normed_input)`` plus ``ds`` (the grad of the residual sum, or None)."""
    n = weight.shape[0]
    block = row_block(op, n)
    dy2 = _rows(op, dy, n)
    ds2 = None if ds is None else _rows(op, ds, n)
    rows = normed_input.shape[0]
    dx = torch.empty((rows, n), dtype=dx_dtype, device=dy.device)
    dr = None if dr_dtype is None else torch.empty((rows, n), dtype=dr_dtype, device=dy.device)
    programs = persistent_programs(dy.device, rows)
    dw_partial = torch.empty((programs, n), dtype=torch.float32, device=dy.device)
    if rows:
        _rms_norm_bwd[(programs,)](
            dy2, normed_input, weight, rstd, ds2 if ds2 is not None else dy2, dx, dr if dr is not None else dx,
            dw_partial, rows, n, triton.cdiv(rows, programs),
            dy2.stride(0), normed_input.stride(0), ds2.stride(0) if ds2 is not None else 0, dx.stride(0),
            dr.stride(0) if dr is not None else 0,
            HAS_DS=ds is not None, HAS_DR=dr is not None, BLOCK=block, num_warps=warps_for(block),
        )
        dw = dw_partial.sum(0)
    else:
        dw = torch.zeros(n, dtype=torch.float32, device=dy.device)
    return dx, dr, dw.to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2, y2, _, rstd = _forward("rms_norm", x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y2.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, _, dw = _backward("rms_norm", dy, x2, weight.contiguous(), rstd, None, ctx.x_dtype, None)
        return (
            dx.view(ctx.x_shape) if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None,
            None,
        )


class _RMSNormWithResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.set_materialize_grads(False)
        x2, y2, _, rstd = _forward("rms_norm_with_residual", x, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y2.view(x.shape), x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dr):
        x2, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the passed-on input was used
            return dr, None, None
        dx, _, dw = _backward("rms_norm_with_residual", dy, x2, weight.contiguous(), rstd, dr, ctx.x_dtype, None)
        return (
            dx.view(ctx.x_shape) if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None,
            None,
        )


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        ctx.set_materialize_grads(False)
        _, y2, s2, rstd = _forward("add_rms_norm", x, residual, weight, eps)
        ctx.save_for_backward(s2, weight, rstd)
        ctx.shape, ctx.x_dtype, ctx.r_dtype = x.shape, x.dtype, residual.dtype
        return y2.view(x.shape), s2.view(x.shape)

    @staticmethod
    def backward(ctx, dy, ds):
        s2, weight, rstd = ctx.saved_tensors
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        if dy is None:  # only the residual sum was used: its grad passes straight to both inputs
            dsum = ds.reshape(ctx.shape)
            return dsum.to(ctx.x_dtype, copy=True), dsum.to(ctx.r_dtype, copy=True), None, None
        # one kernel pass writes the summed-input grad, once per dtype the inputs that need it have;
        # inputs of one dtype get the same tensor object, as autograd's own add hands them (so that
        # neither is accumulated into in place while the other holds it)
        first_dtype = ctx.x_dtype if need_x else ctx.r_dtype
        second_dtype = ctx.r_dtype if need_x and need_r and ctx.r_dtype != ctx.x_dtype else None
        d_first, d_second, dw = _backward("add_rms_norm", dy, s2, weight.contiguous(), rstd, ds, first_dtype, second_dtype)
        first = d_first.view(ctx.shape)
        second = d_second.view(ctx.shape) if d_second is not None else first
        dx, dr = (first, second if need_r else None) if need_x else (None, first)
        return dx, dr, dw if need_w else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused ``loongforge.core.kernels.reference.rms_norm``."""
    return _RMSNorm.apply(x, weight, eps)


def rms_norm_with_residual(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``loongforge.core.kernels.reference.rms_norm_with_residual``: ``(rms_norm(x), x)``."""
    return _RMSNormWithResidual.apply(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``loongforge.core.kernels.reference.add_rms_norm``: ``(rms_norm(x + residual), x + residual)``."""
    return _AddRMSNorm.apply(x, residual, weight, eps)
