"""Fused split + RoPE of megatron's grouped QKV projection output (Triton), forward and backward.

Contract: ``loongforge.llm.ops.grouped_qkv_rope.grouped_qkv_rope``. One program handles one token:
its ``qkv`` row (every group's query heads, key head and value head, contiguous) is read once,
the query and key heads rotated with the token's ``cos``/``sin`` row, and the heads written to the
contiguous ``query``, ``key`` and ``value`` outputs. The backward reads the three output gradients
(any token and head strides) and writes the ``qkv`` gradient row in one pass, rotating back the
query and key heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.shapes import check_shapes
from loongforge.kernels.launch import check_tensors, row_block


@triton.jit
def _grouped_qkv_rope(
    QKV, COS, SIN, Q, K, V,
    batch, per_group, n_heads, half, n_pass,
    stride_xs, stride_xb, stride_cs, stride_cb,
    stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_kh, stride_vs, stride_vb, stride_vh,
    HEAD_DIM: tl.constexpr, BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Forward: QKV (``[S, B, G, P + 2, D]``, heads contiguous) -> Q, K, V. Backward
    (``BACKWARD``): Q, K, V hold the output gradients and QKV receives the input gradient."""
    t = tl.program_id(0).to(tl.int64)
    s = t // batch
    b = t % batch
    heads = tl.arange(0, BLOCK_H)[:, None]  # the row's heads: group g's j-th of P + 2
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    group = heads // (per_group + 2)
    j = heads % (per_group + 2)
    live = heads < n_heads
    is_q = live & (j < per_group)
    is_k = live & (j == per_group)
    is_v = live & (j == per_group + 1)
    rotated = (is_q | is_k) & (dims < half)
    dim_mask = dims < half
    c1 = tl.load(COS + s * stride_cs + b * stride_cb + dims, mask=dim_mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + s * stride_cs + b * stride_cb + half + dims, mask=dim_mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + s * stride_cs + b * stride_cb + dims, mask=dim_mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + s * stride_cs + b * stride_cb + half + dims, mask=dim_mask, other=0.0).to(tl.float32)
    row = QKV + s * stride_xs + b * stride_xb + heads * HEAD_DIM
    q_row = Q + s * stride_qs + b * stride_qb + (group * per_group + j) * stride_qh
    k_row = K + s * stride_ks + b * stride_kb + group * stride_kh
    v_row = V + s * stride_vs + b * stride_vb + group * stride_vh
    m = live & dim_mask
    if BACKWARD:  # each head's output gradient, from whichever output holds that head
        x1 = (tl.load(q_row + dims, mask=is_q & dim_mask, other=0.0).to(tl.float32)
              + tl.load(k_row + dims, mask=is_k & dim_mask, other=0.0).to(tl.float32)
              + tl.load(v_row + dims, mask=is_v & dim_mask, other=0.0).to(tl.float32))
        x2 = (tl.load(q_row + half + dims, mask=is_q & dim_mask, other=0.0).to(tl.float32)
              + tl.load(k_row + half + dims, mask=is_k & dim_mask, other=0.0).to(tl.float32)
              + tl.load(v_row + half + dims, mask=is_v & dim_mask, other=0.0).to(tl.float32))
        y1 = tl.where(rotated, x1 * c1 + x2 * s2, x1)  # the rotation transposed
        y2 = tl.where(rotated, x2 * c2 - x1 * s1, x2)
        tl.store(row + dims, y1.to(QKV.dtype.element_ty), mask=m)
        tl.store(row + half + dims, y2.to(QKV.dtype.element_ty), mask=m)
        if HAS_PASS:
            rest = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
            pm = rest < HEAD_DIM
            g = (tl.load(q_row + rest, mask=is_q & pm, other=0.0) + tl.load(k_row + rest, mask=is_k & pm, other=0.0)
                 + tl.load(v_row + rest, mask=is_v & pm, other=0.0))
            tl.store(row + rest, g, mask=live & pm)
    else:
        x1 = tl.load(row + dims, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + half + dims, mask=m, other=0.0).to(tl.float32)
        y1 = tl.where(rotated, x1 * c1 - x2 * s1, x1)
        y2 = tl.where(rotated, x2 * c2 + x1 * s2, x2)
        y1, y2 = y1.to(Q.dtype.element_ty), y2.to(Q.dtype.element_ty)
        tl.store(q_row + dims, y1, mask=is_q & dim_mask)
        tl.store(q_row + half + dims, y2, mask=is_q & dim_mask)
        tl.store(k_row + dims, y1, mask=is_k & dim_mask)
        tl.store(k_row + half + dims, y2, mask=is_k & dim_mask)
        tl.store(v_row + dims, y1, mask=is_v & dim_mask)
        tl.store(v_row + half + dims, y2, mask=is_v & dim_mask)
        if HAS_PASS:
            rest = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
            pm = rest < HEAD_DIM
            x = tl.load(row + rest, mask=live & pm, other=0.0)
            tl.store(q_row + rest, x, mask=is_q & pm)
            tl.store(k_row + rest, x, mask=is_k & pm)
            tl.store(v_row + rest, x, mask=is_v & pm)


def _launch(qkv, cos, sin, q, k, v, backward: bool) -> None:
    s, b, groups, heads_per_row, d = qkv.shape
    rot = cos.shape[-1]
    if s * b == 0:
        return
    _grouped_qkv_rope[(s * b,)](
        qkv, cos, sin, q, k, v,
        b, heads_per_row - 2, groups * heads_per_row, rot // 2, d - rot,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        HEAD_DIM=d, BACKWARD=backward, HAS_PASS=d > rot,
        BLOCK_H=triton.next_power_of_2(groups * heads_per_row), BLOCK_HALF=row_block("grouped_qkv_rope", rot // 2),
        BLOCK_PASS=triton.next_power_of_2(max(d - rot, 1)),
    )


def _heads_contiguous(qkv: torch.Tensor) -> torch.Tensor:
    """``qkv`` with each token's ``[G, P + 2, D]`` row contiguous (any token strides)."""
    g, h, d = qkv.shape[2:]
    if qkv.stride(4) == 1 and qkv.stride(3) == d and qkv.stride(2) == h * d:
        return qkv
    return qkv.contiguous()


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _GroupedQkvRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin):
        sizes = check_shapes("grouped_qkv_rope", qkv=(qkv, "S B G P2 D"), cos=(cos, "S B R"), sin=(sin, "S B R"))
        groups, per_group, rot = sizes["G"], sizes["P2"] - 2, sizes["R"]
        if per_group < 1 or rot % 2 or rot > sizes["D"]:
            raise ValueError(f"grouped_qkv_rope: qkv {tuple(qkv.shape)} needs at least one query head per group and "
                             f"cos/sin an even rot_dim <= head_dim, got {rot}")
        check_tensors("grouped_qkv_rope", qkv, cos, sin)
        qkv = _heads_contiguous(qkv)
        cos, sin = _unit_last_stride(cos), _unit_last_stride(sin)
        s, b, _, _, d = qkv.shape
        q = torch.empty((s, b, groups * per_group, d), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((s, b, groups, d), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        _launch(qkv, cos, sin, q, k, v, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.qkv_shape, ctx.qkv_dtype = qkv.shape, qkv.dtype
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        s, b, groups, heads_per_row, d = ctx.qkv_shape
        zeros = {"dq": (s, b, groups * (heads_per_row - 2), d), "dk": (s, b, groups, d), "dv": (s, b, groups, d)}
        grads = []
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):  # an unused output gets no gradient
            grads.append(_unit_last_stride(g) if g is not None else cos.new_zeros(zeros[name], dtype=ctx.qkv_dtype))
        dqkv = torch.empty(ctx.qkv_shape, dtype=ctx.qkv_dtype, device=cos.device)
        _launch(dqkv, cos, sin, *grads, backward=True)
        return dqkv, None, None


def grouped_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``loongforge.llm.ops.grouped_qkv_rope.grouped_qkv_rope``."""
    return _GroupedQkvRope.apply(qkv, cos, sin)
