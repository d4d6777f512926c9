"""Blockwise FP8 building blocks for Hopper: quantisation kernels and the scaled GEMM (Triton).

Numerics: loongforge-llm's ``loongforge.llm.ops.fp8_blockwise`` (1x128 blocks for activations and
grads, 128x128 for weights, fp32 ``amax * (1/448)`` scales; e4m3's constants from core's
``fp8_format``). The quantisers divide with IEEE rounding (``div_rn``),
so on a GPU their e4m3 values and scales are bitwise those of the torch reference.

Every GEMM here is ``C = A @ B.T`` with both operands K-major (the layout Hopper's FP8 tensor
cores read), A scaled per 1x128 block and B either per 128x128 block (a weight) or per 1x128
block (an activation in the weight-grad GEMM). Two implementations:

- ``triton``: a tiled kernel with ``BLOCK_K = 128``, so each K step's partial product is one
  scale block and is rescaled in fp32 before it is added (DeepSeek-V3's promotion of the
  tensor-core partial sums);
- ``scaled_mm``: ``torch._scaled_mm`` with blockwise scales (cuBLASLt, sm_90, CUDA >= 12.9).
  Its scale layouts have changed between torch releases and it can return wrong numbers at
  some shapes without an error, so the first call at each shape (and scale kind and output
  dtype) is checked against the Triton kernel on the same operands; a mismatch or an error
  turns it off for that shape, with a warning.

``LOONGFORGE_FP8_GEMM=auto|triton|scaled_mm`` picks one (auto: ``scaled_mm`` where it checks
out, else ``triton``).
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.fp8_format import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, INV_FP8_MAX
from loongforge.kernels.launch import check_tensors

GEMM_ENV = "LOONGFORGE_FP8_GEMM"
GEMM_BACKENDS = ("auto", "triton", "scaled_mm")
QUANT_ROWS = 32  # rows per program of the 1x128 quantiser
BLOCK = 128  # the recipe's scaling block (the reference's ``fp8_blockwise.BLOCK``; a test checks they agree)


@triton.jit
def _quant_rows(
    X, Q, S, n_rows, n_cols, stride_x, stride_q, stride_s, stride_sk,
    AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1)
    cols = kb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR) * INV_FP8_MAX
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(Q + rows64[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows64 * stride_s + kb * stride_sk, scale, mask=rows < n_rows)


@triton.jit
def _quant_cols_transposed(
    X, QT, ST, n_rows, n_cols, stride_x, stride_qt, stride_st, stride_stk,
    AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rb = tl.program_id(0)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    cols64 = cols.to(tl.int64)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_FLOOR) * INV_FP8_MAX
    q = tl.clamp(tl.math.div_rn(x, scale[None, :]), -FP8_MAX, FP8_MAX)
    tl.store(QT + cols64[None, :] * stride_qt + rows[:, None], q.to(QT.dtype.element_ty), mask=mask)
    tl.store(ST + cols64 * stride_st + rb * stride_stk, scale, mask=cols < n_cols)


@triton.jit
def _quant_rows_and_cols(
    X, Q, S, QT, ST, n_rows, n_cols, stride_x, stride_q, stride_s, stride_sk, stride_qt, stride_st, stride_stk,
    AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
    SUB_R: tl.constexpr,
):
    # one 128x128 tile: its rows' 1x128 blocks (as _quant_rows) and its columns' (as
    # _quant_cols_transposed, written transposed), in slices of SUB_R rows so that a slice stays in
    # registers: the first pass quantises the rows and takes the columns' amax, the second reads
    # the slices again (from L2: the tile was just read) and quantises the columns
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    cols64 = cols.to(tl.int64)
    col_amax = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(0, BLOCK, SUB_R):
        rows = rb * BLOCK + r + tl.arange(0, SUB_R)
        rows64 = rows.to(tl.int64)
        mask = (rows[:, None] < n_rows) & col_ok[None, :]
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        col_amax = tl.maximum(col_amax, tl.max(ax, axis=0))
        row_scale = tl.maximum(tl.max(ax, axis=1), AMAX_FLOOR) * INV_FP8_MAX
        q = tl.clamp(tl.math.div_rn(x, row_scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(Q + rows64[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
        tl.store(S + rows64 * stride_s + cb * stride_sk, row_scale, mask=rows < n_rows)
    col_scale = tl.maximum(col_amax, AMAX_FLOOR) * INV_FP8_MAX
    for r in range(0, BLOCK, SUB_R):
        rows = rb * BLOCK + r + tl.arange(0, SUB_R)
        mask = (rows[:, None] < n_rows) & col_ok[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        qt = tl.clamp(tl.math.div_rn(x, col_scale[None, :]), -FP8_MAX, FP8_MAX)
        tl.store(QT + cols64[None, :] * stride_qt + rows[:, None], qt.to(QT.dtype.element_ty), mask=mask)
    tl.store(ST + cols64 * stride_st + rb * stride_stk, col_scale, mask=col_ok)


@triton.jit
def _quant_blocks(
    W, Q, S, n_rows, n_cols, stride_w, stride_q, stride_s,
    AMAX_FLOOR: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
):
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    rows = rb * BLOCK + tl.arange(0, BLOCK)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)
    w = tl.load(W + rows64[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), AMAX_FLOOR) * INV_FP8_MAX
    q = tl.clamp(tl.math.div_rn(w, scale), -FP8_MAX, FP8_MAX)
    tl.store(Q + rows64[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rb * stride_s + cb, scale)


@triton.jit
def _fp8_gemm(
    A, B, SA, SB, C,
    M, N, K,
    stride_am, stride_bn, stride_cm, stride_sa, stride_sak, stride_sb, stride_sbk,
    B_BLOCKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * grid_n  # programs of GROUP_M consecutive row blocks share B tiles in L2
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptr = B + rn[:, None].to(tl.int64) * stride_bn + rk[None, :]
    sa_ptr = SA + rm.to(tl.int64) * stride_sa
    if B_BLOCKED:  # one scale per 128x128 block of B: BLOCK_N == 128 makes it one per tile and step
        sb_ptr = SB + pid_n * stride_sb
    else:
        sb_ptr = SB + rn.to(tl.int64) * stride_sb
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - kb * BLOCK_K
        a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_ptr + kb * stride_sak, mask=m_ok, other=0.0)
        partial = tl.dot(a, tl.trans(b))
        if B_BLOCKED:
            acc += partial * (sa * tl.load(sb_ptr + kb * stride_sbk))[:, None]
        else:
            sb = tl.load(sb_ptr + kb * stride_sbk, mask=n_ok, other=0.0)
            acc += partial * sa[:, None] * sb[None, :]
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    c_ptr = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _blocks(n: int) -> int:
    return triton.cdiv(n, BLOCK)


def _rows_contiguous(op: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{op}: expected a matrix, got shape {tuple(x.shape)}")
    check_tensors(op, x)
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_scales(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """``[rows, cols/128]`` fp32 scales stored row index fastest (outer-dim-major): the layout
    cuBLASLt reads 1x128 scales in, so ``scaled_mm_fp8_gemm`` passes them on without a copy."""
    return torch.empty((_blocks(cols), rows), dtype=torch.float32, device=device).t()


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``loongforge.llm.ops.fp8_blockwise.quantize_1x128``: ``q [R, C]`` e4m3, ``scale [R, C/128]``
    (outer-dim-major, see ``_row_scales``)."""
    x = _rows_contiguous("quantize_1x128", x)
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = _row_scales(rows, cols, x.device)
    if x.numel():
        _quant_rows[(triton.cdiv(rows, QUANT_ROWS), _blocks(cols))](
            x, q, scale, rows, cols, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, BLOCK_R=QUANT_ROWS, BLOCK_C=BLOCK,
            num_warps=4,
        )
    return q, scale


def quantize_1x128_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_1x128(x.T)`` without forming ``x.T``: ``q [C, R]`` e4m3, ``scale [C, R/128]``."""
    x = _rows_contiguous("quantize_1x128_transposed", x)
    rows, cols = x.shape
    q = torch.empty((cols, rows), dtype=FP8_DTYPE, device=x.device)
    scale = _row_scales(cols, rows, x.device)
    if x.numel():
        _quant_cols_transposed[(_blocks(rows), triton.cdiv(cols, 64))](
            x, q, scale, rows, cols, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, BLOCK_R=BLOCK, BLOCK_C=64,
            num_warps=4,
        )
    return q, scale


def quantize_1x128_both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_1x128` and :func:`quantize_1x128_transposed` of ``x`` from one read of it:
    ``q [R, C]``, ``scale [R, C/128]``, ``q_t [C, R]``, ``scale_t [C, R/128]`` (bitwise theirs)."""
    x = _rows_contiguous("quantize_1x128_both", x)
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = _row_scales(rows, cols, x.device)
    q_t = torch.empty((cols, rows), dtype=FP8_DTYPE, device=x.device)
    scale_t = _row_scales(cols, rows, x.device)
    if x.numel():
        _quant_rows_and_cols[(_blocks(rows), _blocks(cols))](
            x, q, scale, q_t, scale_t, rows, cols, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            q_t.stride(0), scale_t.stride(0), scale_t.stride(1), AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, BLOCK=BLOCK,
            SUB_R=QUANT_ROWS, num_warps=4,
        )
    return q, scale, q_t, scale_t


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``loongforge.llm.ops.fp8_blockwise.quantize_128x128``: ``q [N, K]`` e4m3, ``scale [N/128, K/128]``."""
    w = _rows_contiguous("quantize_128x128", w)
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((_blocks(rows), _blocks(cols)), dtype=torch.float32, device=w.device)
    if w.numel():
        _quant_blocks[(_blocks(rows), _blocks(cols))](
            w, q, scale, rows, cols, w.stride(0), q.stride(0), scale.stride(0),
            AMAX_FLOOR=AMAX_FLOOR, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, BLOCK=BLOCK, num_warps=8,
        )
    return q, scale


GEMM_BLOCK_M = 128
GEMM_BLOCK_N = 128  # must be 128: one weight-scale block per tile column
GEMM_GROUP_M = 8


def _check_gemm(a_q, a_s, b_q, b_s, b_blocked):
    m, k = a_q.shape
    n = b_q.shape[0]
    want_b_s = (_blocks(n), _blocks(k)) if b_blocked else (n, _blocks(k))
    if b_q.shape[1] != k or tuple(a_s.shape) != (m, _blocks(k)) or tuple(b_s.shape) != want_b_s:
        raise ValueError(
            f"fp8_gemm: operands do not match: a {tuple(a_q.shape)} scale {tuple(a_s.shape)}, b {tuple(b_q.shape)} "
            f"scale {tuple(b_s.shape)} (expected a scale {(m, _blocks(k))}, b scale {want_b_s})"
        )
    for name, t in (("a", a_q), ("b", b_q)):
        if t.dtype != FP8_DTYPE or t.stride(-1) != 1:
            raise ValueError(f"fp8_gemm: {name} must be a K-contiguous {FP8_DTYPE} matrix, got {t.dtype} strides {t.stride()}")


def triton_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` by the Triton kernel, ``[M, N]`` in ``out_dtype``."""
    _check_gemm(a_q, a_s, b_q, b_s, b_blocked)
    check_tensors("fp8_gemm", a_q, a_s, b_q, b_s)
    m, k = a_q.shape
    n = b_q.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if c.numel():
        grid = (triton.cdiv(m, GEMM_BLOCK_M) * triton.cdiv(n, GEMM_BLOCK_N),)
        _fp8_gemm[grid](
            a_q, b_q, a_s, b_s, c, m, n, k,
            a_q.stride(0), b_q.stride(0), c.stride(0), a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1),
            B_BLOCKED=b_blocked, BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=BLOCK, GROUP_M=GEMM_GROUP_M,
            num_warps=8, num_stages=3,
        )
    return c


def scaled_mm_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` by ``torch._scaled_mm`` with blockwise scales (cuBLASLt).

    cuBLASLt wants A row-major and B column-major (``b_q.t()`` of a K-contiguous B), 1x128 scales
    outer-dim-major (stride 1 along M or N) and 128x128 scales inner-dim-major. The quantisers here
    write 1x128 scales outer-dim-major already (the ``.contiguous()`` calls copy nothing then);
    scales of another layout (the reference's) are copied into it.
    """
    _check_gemm(a_q, a_s, b_q, b_s, b_blocked)
    scale_a = a_s.t().contiguous().t()
    scale_b = b_s.t() if b_blocked else b_s.t().contiguous()
    return torch._scaled_mm(a_q, b_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


# (b_blocked, out_dtype, M, N, K) -> whether torch._scaled_mm gave the Triton kernel's numbers at
# that shape: checked per shape, since cuBLASLt's blockwise path can run without error and still
# return wrong numbers at some shapes (seen on an H200 with a 64x256x128 GEMM)
_SCALED_MM_OK: dict[tuple[bool, torch.dtype, int, int, int], bool] = {}


def gemm_backend() -> str:
    """The configured backend (``LOONGFORGE_FP8_GEMM``)."""
    backend = os.environ.get(GEMM_ENV, "auto").lower()
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"{GEMM_ENV}={backend!r} is not one of {GEMM_BACKENDS}")
    return backend


def _scaled_mm_checks_out(key, a_q, a_s, b_q, b_s, b_blocked, out_dtype) -> bool:
    if key not in _SCALED_MM_OK:
        try:
            got = scaled_mm_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, out_dtype).float()
            want = triton_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, out_dtype).float()
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            ok = err < 1e-2
            reason = f"relative difference {err:.3g} from the Triton kernel"
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        if not ok:
            warnings.warn(
                f"torch._scaled_mm blockwise FP8 ({'128x128' if b_blocked else '1x128'} B scales, {out_dtype}, "
                f"M x N x K = {key[2]}x{key[3]}x{key[4]}) is not usable here ({reason}); using the Triton FP8 GEMM for it",
                stacklevel=3,
            )
        _SCALED_MM_OK[key] = ok
    return _SCALED_MM_OK[key]


def fp8_gemm(a_q, a_s, b_q, b_s, b_blocked: bool, out_dtype: torch.dtype, backend: str | None = None) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T``: ``a_q [M, K]`` with 1x128 ``a_s [M, K/128]``; ``b_q [N, K]`` with
    128x128 ``b_s [N/128, K/128]`` (``b_blocked``) or 1x128 ``b_s [N, K/128]``."""
    backend = backend or gemm_backend()
    if backend == "triton" or a_q.device.type != "cuda":
        return triton_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, out_dtype)
    if backend == "scaled_mm":
        return scaled_mm_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, out_dtype)
    key = (b_blocked, out_dtype, a_q.shape[0], b_q.shape[0], a_q.shape[1])
    if _scaled_mm_checks_out(key, a_q, a_s, b_q, b_s, b_blocked, out_dtype):
        return scaled_mm_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, out_dtype)
    return triton_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, out_dtype)
