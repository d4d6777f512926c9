"""Fused rotary position embedding, rotate-half convention (Triton), forward and backward.

Contract: ``loongforge.core.kernels.reference.rope``. One program handles one token: every head of
it, rotated with that token's ``cos``/``sin`` row, so packed (THD) batches work unchanged (their
cos/sin rows are gathered per token). Dims past ``rot_dim`` are copied through. The backward is
the same rotation with the sine transposed; grads of ``cos``/``sin`` (rarely needed) come from a
second kernel that reduces over heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.kernels.launch import check_tensors, row_block


@triton.jit
def _rope_rotate(
    X, COS, SIN, Y,
    n_heads, half, n_pass,
    stride_xt, stride_xh, stride_yt, stride_yh, stride_ct, stride_st,
    TRANSPOSE: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < half
    mask = (heads < n_heads) & dim_mask
    c1 = tl.load(COS + t * stride_ct + dims, mask=dim_mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + t * stride_ct + half + dims, mask=dim_mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + t * stride_st + dims, mask=dim_mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + t * stride_st + half + dims, mask=dim_mask, other=0.0).to(tl.float32)
    x_row = X + t * stride_xt + heads * stride_xh
    y_row = Y + t * stride_yt + heads * stride_yh
    x1 = tl.load(x_row + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + dims, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:  # backward: dx = dy * cos + rotate_half^T(dy * sin)
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # forward: y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_row + dims, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + half + dims, y2.to(Y.dtype.element_ty), mask=mask)
    if HAS_PASS:
        rest = tl.arange(0, BLOCK_PASS)[None, :]
        pass_mask = (heads < n_heads) & (rest < n_pass)
        tl.store(y_row + 2 * half + rest, tl.load(x_row + 2 * half + rest, mask=pass_mask), mask=pass_mask)


@triton.jit
def _rope_cos_sin_grad(
    DY, X, DCOS, DSIN,
    n_heads, half,
    stride_dyt, stride_dyh, stride_xt, stride_xh,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    dy_row = DY + t * stride_dyt + heads * stride_dyh
    x_row = X + t * stride_xt + heads * stride_xh
    dy1 = tl.load(dy_row + dims, mask=mask, other=0.0).to(tl.float32)
    dy2 = tl.load(dy_row + half + dims, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_row + dims, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + dims, mask=mask, other=0.0).to(tl.float32)
    out = tl.arange(0, BLOCK_HALF)
    out_mask = out < half
    tl.store(DCOS + t * 2 * half + out, tl.sum(dy1 * x1, axis=0), mask=out_mask)
    tl.store(DCOS + t * 2 * half + half + out, tl.sum(dy2 * x2, axis=0), mask=out_mask)
    tl.store(DSIN + t * 2 * half + out, -tl.sum(dy1 * x2, axis=0), mask=out_mask)
    tl.store(DSIN + t * 2 * half + half + out, tl.sum(dy2 * x1, axis=0), mask=out_mask)


def _tokens_heads_dims(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[*tokens, heads, head_dim]``) as ``[tokens, heads, head_dim]`` with unit last stride."""
    t3 = t.reshape(-1, t.shape[-2], t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def _per_token(table: torch.Tensor, lead: torch.Size, name: str, x_shape) -> torch.Tensor:
    """``cos``/``sin`` broadcast to one row per token: ``[tokens, rot_dim]`` with unit last stride."""
    try:
        full = table.expand(*lead, table.shape[-1])
    except RuntimeError as exc:
        raise ValueError(
            f"rope: {name} of shape {tuple(table.shape)} does not broadcast to the tokens {tuple(lead)} of x {tuple(x_shape)}"
        ) from exc
    rows = full.reshape(-1, table.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _rotate(x3, cos2, sin2, transpose: bool, out_dtype) -> torch.Tensor:
    tokens, heads, head_dim = x3.shape
    rot = cos2.shape[-1]
    y = torch.empty((tokens, heads, head_dim), dtype=out_dtype, device=x3.device)
    if tokens:
        _rope_rotate[(tokens,)](
            x3, cos2, sin2, y,
            heads, rot // 2, head_dim - rot,
            x3.stride(0), x3.stride(1), y.stride(0), y.stride(1), cos2.stride(0), sin2.stride(0),
            TRANSPOSE=transpose, HAS_PASS=head_dim > rot,
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=row_block("rope", rot // 2),
            BLOCK_PASS=triton.next_power_of_2(max(head_dim - rot, 1)),
        )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        if x.dim() < 2:
            raise ValueError(f"rope: x must be [*tokens, heads, head_dim], got shape {tuple(x.shape)}")
        if cos.shape != sin.shape:
            raise ValueError(f"rope: cos shape {tuple(cos.shape)} != sin shape {tuple(sin.shape)}")
        rot = cos.shape[-1]
        if rot % 2 or not 0 < rot <= x.shape[-1]:
            raise ValueError(f"rope: rot_dim {rot} (last dim of cos/sin) must be even and in (0, head_dim={x.shape[-1]}]")
        check_tensors("rope", x, cos, sin)
        lead = x.shape[:-2]
        x3 = _tokens_heads_dims(x)
        cos2 = _per_token(cos, lead, "cos", x.shape)
        sin2 = _per_token(sin, lead, "sin", x.shape)
        ctx.save_for_backward(cos2, sin2, x3 if cos.requires_grad or sin.requires_grad else None)
        ctx.x_shape, ctx.x_dtype, ctx.lead = x.shape, x.dtype, lead
        ctx.table_shapes = (cos.shape, cos.dtype, sin.shape, sin.dtype)
        return _rotate(x3, cos2, sin2, False, x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        cos2, sin2, x3 = ctx.saved_tensors
        dy3 = _tokens_heads_dims(dy)
        dx = _rotate(dy3, cos2, sin2, True, ctx.x_dtype).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dcos = dsin = None
        if x3 is not None:
            tokens, heads, _ = x3.shape
            rot = cos2.shape[-1]
            dcos2 = torch.empty((tokens, rot), dtype=torch.float32, device=dy.device)
            dsin2 = torch.empty_like(dcos2)
            if tokens:
                _rope_cos_sin_grad[(tokens,)](
                    dy3, x3, dcos2, dsin2, heads, rot // 2,
                    dy3.stride(0), dy3.stride(1), x3.stride(0), x3.stride(1),
                    BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=row_block("rope", rot // 2),
                )
            cos_shape, cos_dtype, sin_shape, sin_dtype = ctx.table_shapes
            # sum the per-token grads back over the token dims cos/sin were broadcast along
            dcos = dcos2.view(*ctx.lead, rot).sum_to_size(cos_shape).to(cos_dtype) if ctx.needs_input_grad[1] else None
            dsin = dsin2.view(*ctx.lead, rot).sum_to_size(sin_shape).to(sin_dtype) if ctx.needs_input_grad[2] else None
        return dx, dcos, dsin


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Fused ``loongforge.core.kernels.reference.rope`` (rotate-half, partial rotary, packed THD)."""
    return _Rope.apply(x, cos, sin)
