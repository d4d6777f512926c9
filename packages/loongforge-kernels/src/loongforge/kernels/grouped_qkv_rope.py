"""Fused split + RoPE of megatron's grouped QKV projection output (Triton), forward and backward.

Contract: ``loongforge.llm.ops.grouped_qkv_rope.grouped_qkv_rope``. One program handles one token:
its ``qkv`` row (every group's query heads, key head and value head, contiguous) is read once,
the query and key heads rotated with the token's ``cos``/``sin`` row, and the heads written to the
contiguous ``query``, ``key`` and ``value`` outputs. The backward reads the three output gradients
(any token and head strides) and writes the ``qkv`` gradient row in one pass, rotating back the
query and key heads.

``grouped_qkv_norm_rope`` (contract: ``loongforge.llm.ops.grouped_qkv_rope.grouped_qkv_norm_rope``)
does the same with Qwen3's per-head RMSNorm of the query and key heads in the same pass: each
program sums the squares of every head of its token's row, normalises, rounds and rotates; its
backward reads the output gradients and the saved ``qkv`` row, rotates back, runs the norm's
backward per head and writes the ``qkv`` gradient row and one fp32 partial row per token of each
norm weight's gradient (summed by torch afterwards).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.shapes import check_shapes
from loongforge.kernels.launch import check_tensors, row_block, warps_for


@triton.jit
def _token_rows(QKV, Q, K, V, batch, per_group, n_heads,
                stride_xs, stride_xb, stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_kh,
                stride_vs, stride_vb, stride_vh,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """This program's token (``s``, ``b``): its row's heads (group g's j-th of P + 2: query heads, key,
    value) against the first half of the rotated dims, and where each head lives in ``QKV`` and in
    whichever of ``Q``, ``K``, ``V`` holds it."""
    t = tl.program_id(0).to(tl.int64)
    s = t // batch
    b = t % batch
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    group = heads // (per_group + 2)
    j = heads % (per_group + 2)
    live = heads < n_heads
    row = QKV + s * stride_xs + b * stride_xb + heads * HEAD_DIM
    q_row = Q + s * stride_qs + b * stride_qb + (group * per_group + j) * stride_qh
    k_row = K + s * stride_ks + b * stride_kb + group * stride_kh
    v_row = V + s * stride_vs + b * stride_vb + group * stride_vh
    return (t, s, b, heads, dims, live, live & (j < per_group), live & (j == per_group), live & (j == per_group + 1),
            row, q_row, k_row, v_row)


@triton.jit
def _angles(COS, SIN, s, b, stride_cs, stride_cb, half, dims):
    """The token's ``cos``/``sin`` row as its two halves, fp32."""
    m = dims < half
    base = s * stride_cs + b * stride_cb
    c1 = tl.load(COS + base + dims, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + base + half + dims, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + base + dims, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + base + half + dims, mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


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
    t, s, b, heads, dims, live, is_q, is_k, is_v, row, q_row, k_row, v_row = _token_rows(
        QKV, Q, K, V, batch, per_group, n_heads, stride_xs, stride_xb, stride_qs, stride_qb, stride_qh,
        stride_ks, stride_kb, stride_kh, stride_vs, stride_vb, stride_vh, HEAD_DIM, BLOCK_H, BLOCK_HALF)
    dim_mask = dims < half
    rotated = (is_q | is_k) & dim_mask
    c1, c2, s1, s2 = _angles(COS, SIN, s, b, stride_cs, stride_cb, half, dims)
    m = live & dim_mask
    if BACKWARD:  # each head's output gradient, from whichever output holds that head
        x1, x2 = _gathered(q_row, k_row, v_row, is_q, is_k, is_v, dims, dim_mask, half)
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
        _store_rotated(x1, x2, c1, c2, s1, s2, rotated, q_row, k_row, v_row, is_q, is_k, is_v, dims, dim_mask, half)
        if HAS_PASS:
            rest = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
            pm = rest < HEAD_DIM
            x = tl.load(row + rest, mask=live & pm, other=0.0)
            tl.store(q_row + rest, x, mask=is_q & pm)
            tl.store(k_row + rest, x, mask=is_k & pm)
            tl.store(v_row + rest, x, mask=is_v & pm)


@triton.jit
def _gathered(q_row, k_row, v_row, is_q, is_k, is_v, cols, mask, offset):
    """Each head's values at ``offset + cols`` from whichever of the three outputs holds it, fp32:
    the first and second halves (``offset`` 0 and ``half``)."""
    a = (tl.load(q_row + cols, mask=is_q & mask, other=0.0).to(tl.float32)
         + tl.load(k_row + cols, mask=is_k & mask, other=0.0).to(tl.float32)
         + tl.load(v_row + cols, mask=is_v & mask, other=0.0).to(tl.float32))
    b = (tl.load(q_row + offset + cols, mask=is_q & mask, other=0.0).to(tl.float32)
         + tl.load(k_row + offset + cols, mask=is_k & mask, other=0.0).to(tl.float32)
         + tl.load(v_row + offset + cols, mask=is_v & mask, other=0.0).to(tl.float32))
    return a, b


@triton.jit
def _store_rotated(x1, x2, c1, c2, s1, s2, rotated, q_row, k_row, v_row, is_q, is_k, is_v, dims, dim_mask, half):
    """The rotated halves of each head to whichever output holds it (values pass as they are)."""
    y1 = tl.where(rotated, x1 * c1 - x2 * s1, x1).to(q_row.dtype.element_ty)
    y2 = tl.where(rotated, x2 * c2 + x1 * s2, x2).to(q_row.dtype.element_ty)
    tl.store(q_row + dims, y1, mask=is_q & dim_mask)
    tl.store(q_row + half + dims, y2, mask=is_q & dim_mask)
    tl.store(k_row + dims, y1, mask=is_k & dim_mask)
    tl.store(k_row + half + dims, y2, mask=is_k & dim_mask)
    tl.store(v_row + dims, y1, mask=is_v & dim_mask)
    tl.store(v_row + half + dims, y2, mask=is_v & dim_mask)


@triton.jit
def _grouped_qkv_norm_rope(
    QKV, COS, SIN, QW, KW, Q, K, V, DQKV, DWQ, DWK,
    batch, per_group, n_heads, half, eps,
    stride_xs, stride_xb, stride_cs, stride_cb, stride_ds, stride_db,
    stride_qs, stride_qb, stride_qh, stride_ks, stride_kb, stride_kh, stride_vs, stride_vb, stride_vh,
    HEAD_DIM: tl.constexpr, BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Forward: QKV -> Q, K, V, the query and key heads RMS-normalised (weights QW, KW) before the
    rotation. Backward (``BACKWARD``): Q, K, V hold the output gradients; QKV is the saved input,
    DQKV receives its gradient and DWQ / DWK (``[tokens, D]`` fp32) this token's share of the
    weights' gradients."""
    t, s, b, heads, dims, live, is_q, is_k, is_v, row, q_row, k_row, v_row = _token_rows(
        QKV, Q, K, V, batch, per_group, n_heads, stride_xs, stride_xb, stride_qs, stride_qb, stride_qh,
        stride_ks, stride_kb, stride_kh, stride_vs, stride_vb, stride_vh, HEAD_DIM, BLOCK_H, BLOCK_HALF)
    dim_mask = dims < half
    normed = is_q | is_k
    rotated = normed & dim_mask
    c1, c2, s1, s2 = _angles(COS, SIN, s, b, stride_cs, stride_cb, half, dims)
    m = live & dim_mask
    x1 = tl.load(row + dims, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + half + dims, mask=m, other=0.0).to(tl.float32)
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    rest = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
    pm = rest < HEAD_DIM
    if HAS_PASS:
        xp = tl.load(row + rest, mask=live & pm, other=0.0).to(tl.float32)
        squares += tl.sum(xp * xp, axis=1)
    rstd = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]
    w1 = tl.where(is_q, tl.load(QW + dims, mask=dim_mask, other=0.0), tl.load(KW + dims, mask=dim_mask, other=0.0))
    w2 = tl.where(is_q, tl.load(QW + half + dims, mask=dim_mask, other=0.0),
                  tl.load(KW + half + dims, mask=dim_mask, other=0.0))
    w1, w2 = w1.to(tl.float32), w2.to(tl.float32)
    if BACKWARD:
        g1, g2 = _gathered(q_row, k_row, v_row, is_q, is_k, is_v, dims, dim_mask, half)
        y1 = tl.where(rotated, g1 * c1 + g2 * s2, g1)  # the gradient of the normalised head
        y2 = tl.where(rotated, g2 * c2 - g1 * s1, g2)
        h1, h2 = x1 * rstd, x2 * rstd
        dot = tl.sum(h1 * w1 * y1, axis=1) + tl.sum(h2 * w2 * y2, axis=1)
        if HAS_PASS:
            wp = tl.where(is_q, tl.load(QW + rest, mask=pm, other=0.0), tl.load(KW + rest, mask=pm, other=0.0))
            wp = wp.to(tl.float32)
            gp = (tl.load(q_row + rest, mask=is_q & pm, other=0.0).to(tl.float32)
                  + tl.load(k_row + rest, mask=is_k & pm, other=0.0).to(tl.float32)
                  + tl.load(v_row + rest, mask=is_v & pm, other=0.0).to(tl.float32))
            hp = xp * rstd
            dot += tl.sum(hp * wp * gp, axis=1)
        dot = dot[:, None] / HEAD_DIM
        out = DQKV + s * stride_ds + b * stride_db + heads * HEAD_DIM
        dx1 = tl.where(normed, (w1 * y1 - h1 * dot) * rstd, y1)
        dx2 = tl.where(normed, (w2 * y2 - h2 * dot) * rstd, y2)
        tl.store(out + dims, dx1.to(DQKV.dtype.element_ty), mask=m)
        tl.store(out + half + dims, dx2.to(DQKV.dtype.element_ty), mask=m)
        dwq = DWQ + t * HEAD_DIM
        dwk = DWK + t * HEAD_DIM
        tl.store(dwq + dims, tl.sum(tl.where(is_q, y1 * h1, 0.0), axis=0)[None, :], mask=dim_mask)
        tl.store(dwq + half + dims, tl.sum(tl.where(is_q, y2 * h2, 0.0), axis=0)[None, :], mask=dim_mask)
        tl.store(dwk + dims, tl.sum(tl.where(is_k, y1 * h1, 0.0), axis=0)[None, :], mask=dim_mask)
        tl.store(dwk + half + dims, tl.sum(tl.where(is_k, y2 * h2, 0.0), axis=0)[None, :], mask=dim_mask)
        if HAS_PASS:
            tl.store(out + rest, tl.where(normed, (wp * gp - hp * dot) * rstd, gp).to(DQKV.dtype.element_ty),
                     mask=live & pm)
            tl.store(dwq + rest, tl.sum(tl.where(is_q, gp * hp, 0.0), axis=0)[None, :], mask=pm)
            tl.store(dwk + rest, tl.sum(tl.where(is_k, gp * hp, 0.0), axis=0)[None, :], mask=pm)
    else:  # each normalised head rounded to the input dtype before it is rotated, as the separate ops do
        x1 = tl.where(normed, (x1 * rstd * w1).to(QKV.dtype.element_ty).to(tl.float32), x1)
        x2 = tl.where(normed, (x2 * rstd * w2).to(QKV.dtype.element_ty).to(tl.float32), x2)
        _store_rotated(x1, x2, c1, c2, s1, s2, rotated, q_row, k_row, v_row, is_q, is_k, is_v, dims, dim_mask, half)
        if HAS_PASS:
            wp = tl.where(is_q, tl.load(QW + rest, mask=pm, other=0.0), tl.load(KW + rest, mask=pm, other=0.0))
            xp = tl.where(normed, xp * rstd * wp.to(tl.float32), xp).to(Q.dtype.element_ty)
            tl.store(q_row + rest, xp, mask=is_q & pm)
            tl.store(k_row + rest, xp, mask=is_k & pm)
            tl.store(v_row + rest, xp, mask=is_v & pm)


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


def _launch_norm(qkv, cos, sin, q_weight, k_weight, eps, q, k, v, dqkv=None, dwq=None, dwk=None) -> None:
    s, b, groups, heads_per_row, d = qkv.shape
    rot = cos.shape[-1]
    if s * b == 0:
        return
    backward = dqkv is not None
    out = dqkv if backward else qkv
    block_h, block_half = triton.next_power_of_2(groups * heads_per_row), row_block("grouped_qkv_norm_rope", rot // 2)
    _grouped_qkv_norm_rope[(s * b,)](
        qkv, cos, sin, q_weight, k_weight, q, k, v, out, dwq if backward else cos, dwk if backward else cos,
        b, heads_per_row - 2, groups * heads_per_row, rot // 2, eps,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), out.stride(0), out.stride(1),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        HEAD_DIM=d, BACKWARD=backward, HAS_PASS=d > rot, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(d - rot, 1)),
        num_warps=warps_for(2 * block_h * block_half),  # a dozen [heads, half] fp32 tiles live in the backward
    )


class _GroupedQkvNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, q_weight, k_weight, eps):
        sizes = check_shapes("grouped_qkv_norm_rope", qkv=(qkv, "S B G P2 D"), cos=(cos, "S B R"),
                             sin=(sin, "S B R"), q_weight=(q_weight, "D"), k_weight=(k_weight, "D"))
        groups, per_group, rot = sizes["G"], sizes["P2"] - 2, sizes["R"]
        if per_group < 1 or rot % 2 or rot > sizes["D"]:
            raise ValueError(f"grouped_qkv_norm_rope: qkv {tuple(qkv.shape)} needs at least one query head per group "
                             f"and cos/sin an even rot_dim <= head_dim, got {rot}")
        check_tensors("grouped_qkv_norm_rope", qkv, cos, sin, q_weight, k_weight)
        qkv = _heads_contiguous(qkv)
        cos, sin = _unit_last_stride(cos), _unit_last_stride(sin)
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
        s, b, _, _, d = qkv.shape
        q = torch.empty((s, b, groups * per_group, d), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((s, b, groups, d), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        _launch_norm(qkv, cos, sin, q_weight, k_weight, eps, q, k, v)
        ctx.save_for_backward(qkv, cos, sin, q_weight, k_weight)
        ctx.eps = eps
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        qkv, cos, sin, q_weight, k_weight = ctx.saved_tensors
        s, b, groups, heads_per_row, d = qkv.shape
        zeros = {"dq": (s, b, groups * (heads_per_row - 2), d), "dk": (s, b, groups, d), "dv": (s, b, groups, d)}
        grads = [_unit_last_stride(g) if g is not None else qkv.new_zeros(zeros[name])
                 for name, g in (("dq", dq), ("dk", dk), ("dv", dv))]  # an unused output gets no gradient
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        dwq = torch.empty((s * b, d), dtype=torch.float32, device=qkv.device)
        dwk = torch.empty_like(dwq)
        _launch_norm(qkv, cos, sin, q_weight, k_weight, ctx.eps, *grads, dqkv=dqkv, dwq=dwq, dwk=dwk)
        return dqkv, None, None, dwq.sum(0).to(q_weight.dtype), dwk.sum(0).to(k_weight.dtype), None


def grouped_qkv_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``loongforge.llm.ops.grouped_qkv_rope.grouped_qkv_norm_rope``."""
    return _GroupedQkvNormRope.apply(qkv, cos, sin, q_weight, k_weight, eps)
