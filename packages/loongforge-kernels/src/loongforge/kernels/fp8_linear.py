"""Blockwise FP8 linear layer with FP8 forward and backward GEMMs, and its adaptive mode.

Contract: ``fp8_linear`` (loongforge-llm's ``loongforge.llm.ops.fp8_blockwise``). The forward
quantises ``x`` (1x128) and the master weight (128x128) and runs ``y = x @ w.T`` in FP8; it saves the weight's e4m3 copy
for the input-grad GEMM and ``x`` quantised along the token dim (transposed, 1 byte per element)
for the weight-grad GEMM, so no bf16 activation is kept. The backward quantises ``dy`` both ways
and runs ``dx = dy @ w`` and ``dw = dy.T @ x`` in FP8 (see ``fp8_gemm`` for the GEMMs).

FP8 is not faster for every shape: quantising costs memory passes, and small or skinny GEMMs are
bound by them. ``adaptive=True`` decides per GEMM: the first time a ``(M, N, K)`` is seen, each of
its three GEMMs is timed on this device in bf16 and in FP8 (quantisation included), and the
faster one is used from then on. The table is kept per process; :func:`adaptive_table` prints it.
The timing runs eagerly (it synchronises), so call a new shape once outside CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongforge.core.kernels.fp8_format import check_linear
from loongforge.kernels import fp8_gemm as gemm

GEMMS = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class GemmChoice:
    """One GEMM of one linear shape in the adaptive table."""

    gemm: str  # fprop (y = x w^T), dgrad (dx = dy w), wgrad (dw = dy^T x)
    m: int
    n: int
    k: int
    bf16_ms: float
    fp8_ms: float

    @property
    def use_fp8(self) -> bool:
        return self.fp8_ms < self.bf16_ms


@dataclass(frozen=True)
class Plan:
    """Which of a linear's three GEMMs run in FP8."""

    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True


ALL_FP8 = Plan()

# (tokens, out_features, in_features, activation dtype, device) -> the three choices
_TABLE: dict[tuple, tuple[GemmChoice, GemmChoice, GemmChoice]] = {}


def time_ms(fn, reps: int = 5, warmup: int = 2) -> float:
    """Mean CUDA milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[GemmChoice, ...]:
    """Time the three GEMMs of a ``[m, k] x [n, k]^T`` linear in bf16 and in FP8 (with quantisation).

    Weights are timed in the activation dtype: the bf16 side leaves out casting an fp32 master.
    """
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fp8_linear(adaptive=True): shape (M={m}, N={n}, K={k}) is new and cannot be timed during "
            f"CUDA-graph capture; run it once before capturing"
        )
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    wq, ws = gemm.quantize_128x128(w)
    wq_t, ws_t = wq.t().contiguous(), ws.t().contiguous()

    def fprop_fp8():  # the weight is quantised (and its K-major copy made) once per forward
        q, s = gemm.quantize_128x128(w)
        q.t().contiguous()
        return gemm.fp8_gemm(*gemm.quantize_1x128(x), q, s, True, dtype)

    def dgrad_fp8():
        return gemm.fp8_gemm(*gemm.quantize_1x128(dy), wq_t, ws_t, True, dtype)

    def wgrad_fp8():  # x's transposed quantisation happens in the forward, for this GEMM only
        return gemm.fp8_gemm(*gemm.quantize_1x128_transposed(dy), *gemm.quantize_1x128_transposed(x), False, dtype)

    return (
        GemmChoice("fprop", m, n, k, time_ms(lambda: x @ w.t()), time_ms(fprop_fp8)),
        GemmChoice("dgrad", m, k, n, time_ms(lambda: dy @ w), time_ms(dgrad_fp8)),
        GemmChoice("wgrad", n, k, m, time_ms(lambda: dy.t() @ x), time_ms(wgrad_fp8)),
    )


def adaptive_plan(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Plan:
    """The per-GEMM choice for this linear shape, measured on first use and cached."""
    key = (m, n, k, dtype, device)
    if key not in _TABLE:
        _TABLE[key] = measure(m, n, k, dtype, device)
    fprop, dgrad, wgrad = _TABLE[key]
    return Plan(fprop.use_fp8, dgrad.use_fp8, wgrad.use_fp8)


def adaptive_table() -> str:
    """The measured table, one line per GEMM: shapes, bf16 and FP8 times, the choice."""
    lines = [f"{'gemm':<6} {'M':>7} {'N':>7} {'K':>7} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8/bf16':>9}  choice"]
    for choices in _TABLE.values():
        for c in choices:
            lines.append(
                f"{c.gemm:<6} {c.m:>7} {c.n:>7} {c.k:>7} {c.bf16_ms:>9.3f} {c.fp8_ms:>9.3f} "
                f"{c.bf16_ms / c.fp8_ms:>8.2f}x  {'fp8' if c.use_fp8 else 'bf16'}"
            )
    return "\n".join(lines)


def clear_adaptive_table() -> None:
    _TABLE.clear()


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, plan: Plan):
        out_dtype = x2.dtype
        w_lo = None
        if plan.fprop or plan.dgrad:
            wq, ws = gemm.quantize_128x128(weight)
        if plan.fprop:
            y = gemm.fp8_gemm(*gemm.quantize_1x128(x2), wq, ws, True, out_dtype)
        else:
            w_lo = weight.to(out_dtype)
            y = x2 @ w_lo.t()
        if bias is not None:
            y = y + bias.to(out_dtype)
        if plan.dgrad:  # the e4m3 weight, K-major for dx = dy @ w
            dgrad_saved = (wq.t().contiguous(), ws.t().contiguous())
        else:
            dgrad_saved = (weight,)
        wgrad_saved = gemm.quantize_1x128_transposed(x2) if plan.wgrad else (x2,)
        ctx.save_for_backward(*dgrad_saved, *wgrad_saved)
        ctx.n_dgrad = len(dgrad_saved)
        ctx.plan, ctx.has_bias, ctx.w_dtype = plan, bias is not None, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        dgrad_saved, wgrad_saved = saved[: ctx.n_dgrad], saved[ctx.n_dgrad :]
        plan = ctx.plan
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if plan.dgrad:
                dx = gemm.fp8_gemm(*gemm.quantize_1x128(dy), *dgrad_saved, True, dy.dtype)
            else:
                dx = dy @ dgrad_saved[0].to(dy.dtype)
        if ctx.needs_input_grad[1]:
            if plan.wgrad:
                dw = gemm.fp8_gemm(*gemm.quantize_1x128_transposed(dy), *wgrad_saved, False, ctx.w_dtype)
            else:
                dw = (dy.t() @ wgrad_saved[0]).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(dy.dtype)
        return dx, dw, db, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, adaptive: bool = False
) -> torch.Tensor:
    """Fused ``fp8_linear``: real e4m3 GEMMs, forward and backward."""
    check_linear("fp8_linear", x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    plan = adaptive_plan(x2.shape[0], weight.shape[0], weight.shape[1], x2.dtype, x2.device) if adaptive else ALL_FP8
    return _Fp8Linear.apply(x2, weight, bias, plan).view(*x.shape[:-1], weight.shape[0])
