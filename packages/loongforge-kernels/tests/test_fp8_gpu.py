"""Blockwise FP8 on a GPU (sm_89+): quantisers bitwise equal to the reference, both GEMM backends,
the FP8 linear against the reference numerics (every GEMM in FP8, and the caller's choice of
GEMMs), and fp8=adaptive's timer on the fused op."""

from __future__ import annotations

import os

import pytest
import torch

from loongforge.llm.ops import fp8_blockwise as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an sm_89+ GPU"
    ),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0 on a GPU"),
]


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("shape", [(64, 64), (50, 64), (128, 128), (37, 160)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantisers_are_bitwise_the_reference_at_one_tile(dtype, shape):
    """One tile, whole or partial (a one-tile fp32 input once got wrong bytes in a transposed copy)."""
    from loongforge.kernels import fp8_gemm as fg

    x = (torch.randn(*shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")).to(dtype)
    x_t = x.t().contiguous()
    for fused, want in ((fg.quantize_1x128(x), ref.quantize_1x128(x)),
                        (fg.quantize_1x128_transposed(x), ref.quantize_1x128(x_t)),
                        (fg.quantize_1x128_both(x)[:2], ref.quantize_1x128(x)),
                        (fg.quantize_1x128_both(x)[2:], ref.quantize_1x128(x_t)),
                        (fg.quantize_128x128(x), ref.quantize_128x128(x))):
        assert torch.equal(fused[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(fused[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantisers_are_bitwise_the_reference(dtype):
    from loongforge.kernels import fp8_gemm as fg

    x = (torch.randn(300, 520, device="cuda") * torch.logspace(-4, 4, 520, device="cuda")).to(dtype)
    aligned = (torch.randn(1024, 768, device="cuda") * torch.logspace(-4, 4, 768, device="cuda")).to(dtype)
    for fused, want in (
        (fg.quantize_1x128_both(aligned)[:2], ref.quantize_1x128(aligned)),  # (every tile whole, another build)
        (fg.quantize_1x128_both(aligned)[2:], ref.quantize_1x128(aligned.t().contiguous())),
        (fg.quantize_1x128(aligned), ref.quantize_1x128(aligned)),
        (fg.quantize_1x128_transposed(aligned), ref.quantize_1x128(aligned.t().contiguous())),
        (fg.quantize_128x128(aligned), ref.quantize_128x128(aligned)),
        (fg.quantize_1x128(x), ref.quantize_1x128(x)),
        (fg.quantize_1x128_transposed(x), ref.quantize_1x128(x.t().contiguous())),
        (fg.quantize_128x128(x), ref.quantize_128x128(x)),
        (fg.quantize_1x128_both(x)[:2], ref.quantize_1x128(x)),
        (fg.quantize_1x128_both(x)[2:], ref.quantize_1x128(x.t().contiguous())),
    ):
        assert fused[0].shape == want[0].shape and fused[1].shape == want[1].shape
        assert torch.equal(fused[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(fused[1], want[1])


def test_auto_backend_is_right_at_every_shape():
    """``auto`` checks ``torch._scaled_mm`` per shape: after it checked out at a large shape, a small
    one (the dgrad GEMM of a 256 -> 128 layer on 64 tokens) must still give the right numbers."""
    from loongforge.kernels import fp8_gemm as fg

    for m, n, k in ((512, 768, 1024), (64, 256, 128), (40, 136, 300)):
        a_q, a_s = ref.quantize_1x128(torch.randn(m, k, device="cuda"))
        b_q, b_s = ref.quantize_128x128(torch.randn(n, k, device="cuda"))
        want = ref.dequantize_1x128(a_q, a_s) @ ref.dequantize_128x128(b_q, b_s).t()
        got = fg.fp8_gemm(a_q, a_s, b_q, b_s, True, torch.float32, backend="auto")
        assert _rel(got, want) < 1e-3, (m, n, k, _rel(got, want))


@pytest.mark.parametrize("b_blocked", [True, False])
def test_gemm_backends_match_the_dequantised_product(b_blocked):
    from loongforge.kernels import fp8_gemm as fg

    m, n, k = 512, 768, 1024
    a_q, a_s = ref.quantize_1x128(torch.randn(m, k, device="cuda"))
    b = torch.randn(n, k, device="cuda")
    b_q, b_s = ref.quantize_128x128(b) if b_blocked else ref.quantize_1x128(b)
    b_deq = ref.dequantize_128x128(b_q, b_s) if b_blocked else ref.dequantize_1x128(b_q, b_s)
    want = ref.dequantize_1x128(a_q, a_s) @ b_deq.t()
    triton_out = fg.triton_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, torch.float32)
    assert _rel(triton_out, want) < 1e-3
    try:
        scaled = fg.scaled_mm_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        print(f"torch._scaled_mm blockwise ({'128x128' if b_blocked else '1x128'} B) unavailable: {exc}")
        return
    err = _rel(scaled, want)
    print(f"torch._scaled_mm blockwise ({'128x128' if b_blocked else '1x128'} B): relative error {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_fp8_linear_matches_the_reference_numerics(monkeypatch, backend):
    from loongforge.kernels.fp8_linear import fp8_linear

    monkeypatch.setenv("LOONGFORGE_FP8_GEMM", backend)
    torch.manual_seed(0)
    x = torch.randn(4, 256, 1024, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(2048, 1024, device="cuda") * 1024**-0.5).requires_grad_()  # fp32 master weight
    bias = torch.randn(2048, device="cuda").to(torch.bfloat16).requires_grad_()
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, bias))
    y = fp8_linear(x, w, bias)
    y_ref = ref.fp8_linear(xr, wr, br)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    errs = dict(y=_rel(y, y_ref), dx=_rel(x.grad, xr.grad), dw=_rel(w.grad, wr.grad), db=_rel(bias.grad, br.grad))
    print(f"fp8_linear ({backend}) relative errors vs reference numerics: {errs}")
    assert all(e < 1e-2 for e in errs.values()), errs


@pytest.mark.parametrize("names", [(), ("dgrad",), ("fprop", "wgrad")])
def test_fp8_linear_honours_the_callers_gemms(names):
    """A GEMM the caller keeps out of FP8 is the input dtype's matmul, as in the reference."""
    from loongforge.core.kernels.fp8_format import Fp8Gemms
    from loongforge.kernels.fp8_linear import fp8_linear

    gemms = Fp8Gemms.from_names(names)
    torch.manual_seed(0)
    x = torch.randn(512, 1024, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(768, 1024, device="cuda") * 1024**-0.5).requires_grad_()
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    y, y_ref = fp8_linear(x, w, gemms=gemms), ref.fp8_linear(xr, wr, gemms=gemms)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    errs = dict(y=_rel(y, y_ref), dx=_rel(x.grad, xr.grad), dw=_rel(w.grad, wr.grad))
    assert all(e < 1e-2 for e in errs.values()), errs


def test_the_adaptive_timer_times_the_fused_op_and_chooses():
    """loongforge-llm's fp8=adaptive timer on the registry's fused ``fp8_linear``: a time for every
    combination of GEMMs in FP8 at each shape, and a choice the reference accepts."""
    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.kernels import KernelPolicy
    from loongforge.llm.layers.fp8_measure import fused_fp8_linear, measure_fp8_plan, registry_linear_timer
    from loongforge.llm.layers.fp8_plan import COMBINATIONS, FP8Plan

    kernels = KernelPolicy()
    assert fused_fp8_linear(kernels) and not fused_fp8_linear(KernelPolicy(force_reference=True))
    timer = registry_linear_timer(kernels, torch.bfloat16, torch.device("cuda"), get_accelerator().synchronize,
                                  reps=3, warmup=1)
    plan = measure_fp8_plan([(4096, 4096), (512, 4096)], 2048, timer, torch.device("cuda"))
    print(plan.table())
    assert [s.key for s in plan.shapes] == [(512, 4096), (4096, 4096)]
    for s in plan.shapes:
        assert len(s.ms) == len(COMBINATIONS) and all(t > 0 for t in s.ms)
        assert s.ms[COMBINATIONS.index(s.gemms)] == min(s.ms)
    assert FP8Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e5m2", [False, True])
@pytest.mark.parametrize("shape", [(1003, 520), (64, 64), (50, 64), (37, 160)])
def test_cast_transpose_is_bitwise_the_reference(dtype, e5m2, shape):
    """Large and one-tile matrices (a one-tile fp32 input once got wrong bytes in its transposed copy)."""
    from loongforge.diffusion.ops.fp8_tensorwise import E4M3, E5M2, cast_transpose, tensor_scale
    from loongforge.kernels.fp8_cast import fp8_cast_transpose

    x = (torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")).to(dtype)
    scale = tensor_scale(x, E5M2 if e5m2 else E4M3)
    got, want = fp8_cast_transpose(x, scale, e5m2), cast_transpose(x, scale, e5m2)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g.view(torch.uint8), w.view(torch.uint8))
