"""Blockwise FP8: reference quantisation error bounds, the Triton GEMM and the FP8 linear's autograd.

On CPU the Triton kernels run in the interpreter, whose fp32 -> e4m3 cast is wrong where rounding
carries into the next binade (124.2 becomes 64, not 128); so here the fused quantisers are
replaced by the reference ones, and the quantisers themselves are compared bitwise on a GPU
(test_fp8_gpu.py). The GEMM kernel takes e4m3 inputs made by torch and is checked as it is.
"""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels.fp8_format import ALL_FP8, Fp8Gemms
from loongforge.kernels import fp8_gemm, fp8_linear
from loongforge.llm.ops import fp8_blockwise as ref

E4M3_EPS = 2.0**-3  # spacing of e4m3 significands: relative rounding error <= EPS / 2 for normal values
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9


def _error_bound(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    """Largest round-to-nearest error of ``x`` on the e4m3 grid scaled by ``scale_full`` (elementwise)."""
    v = x.abs() / scale_full
    normal = v >= E4M3_MIN_NORMAL
    return torch.where(normal, v * E4M3_EPS / 2, torch.full_like(v, E4M3_SUBNORMAL_STEP / 2)) * scale_full * (1 + 1e-6)


def test_1x128_round_trip_error_bound_and_scales():
    torch.manual_seed(0)
    x = torch.randn(7, 300) * torch.logspace(-3, 3, 300)  # magnitudes over 6 decades, a partial last block
    q, scale = ref.quantize_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (7, 3)
    blocks = torch.nn.functional.pad(x, (0, 84)).view(7, 3, 128)
    torch.testing.assert_close(scale, blocks.abs().amax(-1) * (1 / 448.0), rtol=0, atol=0)
    # each block's largest element lands exactly on e4m3's largest value
    qb = torch.nn.functional.pad(q.float(), (0, 84)).view(7, 3, 128)
    assert (qb.abs().amax(-1) == 448.0).all()
    back = ref.dequantize_1x128(q, scale)
    full = scale.repeat_interleave(128, 1)[:, :300]
    assert ((back - x).abs() <= _error_bound(x, full)).all()


def test_128x128_round_trip_error_bound_and_scales():
    torch.manual_seed(1)
    w = torch.randn(200, 260)
    w[150:, 200:] *= 1e4  # an outlier block: its scale must not touch the others
    q, scale = ref.quantize_128x128(w)
    assert q.shape == w.shape and scale.shape == (2, 3)
    assert scale[1, 2] > 1000 * scale[0, 0]
    back = ref.dequantize_128x128(q, scale)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :260]
    assert ((back - w).abs() <= _error_bound(w, full)).all()
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < E4M3_EPS / 2


def test_the_kernels_scale_the_recipes_blocks():
    """The kernels name the recipe's block size themselves (they depend on core alone); it is the reference's."""
    assert fp8_gemm.BLOCK == ref.BLOCK == 128


def test_zero_blocks_stay_zero():
    x = torch.zeros(3, 256)
    x[1, 130] = 5.0
    q, scale = ref.quantize_1x128(x)
    back = ref.dequantize_1x128(q, scale)
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    assert torch.isfinite(scale).all() and (scale > 0).all()


def test_block_scaling_beats_tensor_scaling_with_an_outlier():
    """One outlier flushes a per-tensor-scaled tensor to (near) zero; 1x128 blocks keep e4m3's precision elsewhere."""
    torch.manual_seed(2)
    x = torch.randn(4, 512) * 1e-2
    x[0, 0] = 1e4
    rest = (slice(None), slice(128, None))  # every block without the outlier

    def rel(approx):
        return ((approx - x)[rest].norm() / x[rest].norm()).item()

    tensor_scale = x.abs().max() / 448.0
    assert rel(ref.round_1x128(x)) < E4M3_EPS / 2
    assert rel((x / tensor_scale).to(torch.float8_e4m3fn).float() * tensor_scale) > 0.5


def _linear_leaves(m=96, n=136, k=200, dtype=torch.float32, w_dtype=torch.float32, seed=3):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(w_dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    return x, w, b


def test_reference_fp8_linear_is_close_to_the_exact_linear():
    x, w, b = _linear_leaves()
    xe, we, be = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = ref.fp8_linear(x, w, b)
    ye = torch.nn.functional.linear(xe, we, be)
    assert y.shape == (2, 48, 136) and y.dtype == x.dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    ye.backward(dy)
    for got, want in ((y, ye), (x.grad, xe.grad), (w.grad, we.grad), (b.grad, be.grad)):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 0.05, rel  # e4m3 keeps ~2 significant digits per element; errors average out
    assert w.grad.dtype == torch.float32


def test_reference_fp8_linear_grads_are_the_rounded_gemms():
    """The reference's backward is exactly dx = Q(dy) Q(w), dw = Q(dy^T) Q(x^T)^T (fp32)."""
    x, w, _ = _linear_leaves(m=64, n=128, k=256)
    y = ref.fp8_linear(x, w)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 256), dy.reshape(-1, 128)
    torch.testing.assert_close(x.grad.reshape(-1, 256), ref.round_1x128(dy2) @ ref.round_128x128(w.detach()))
    torch.testing.assert_close(w.grad, ref.round_1x128(dy2.t()) @ ref.round_1x128(x2.t()).t())


@pytest.mark.parametrize("b_blocked", [True, False])
def test_triton_gemm_matches_the_dequantised_product(b_blocked):
    torch.manual_seed(4)
    m, n, k = 40, 136, 300  # nothing a multiple of the 128 tile
    a_q, a_s = ref.quantize_1x128(torch.randn(m, k))
    b = torch.randn(n, k)
    b_q, b_s = ref.quantize_128x128(b) if b_blocked else ref.quantize_1x128(b)
    b_deq = ref.dequantize_128x128(b_q, b_s) if b_blocked else ref.dequantize_1x128(b_q, b_s)
    a_deq = ref.dequantize_1x128(a_q, a_s)
    got = fp8_gemm.triton_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, torch.float32)
    want = a_deq @ b_deq.t()
    if not got.is_cuda:  # the interpreter multiplies and sums in fp32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        return
    # Hopper's FP8 tensor cores sum each 128-wide K step with about 14 significant bits (the kernel
    # promotes every step to fp32), so each output is good to a small fraction of its sum of
    # |products|; a wrong scale or block would be off by O(1) of it
    bound = 2.0**-10 * (a_deq.abs() @ b_deq.abs().t())
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max().item()


@pytest.mark.parametrize("b_blocked", [True, False])
def test_triton_gemm_reads_scales_of_either_layout(b_blocked):
    """The quantisers store 1x128 scales row index fastest (cuBLASLt's layout); the Triton GEMM
    reads them through both strides: the same numbers as from contiguous scales."""
    torch.manual_seed(8)
    m, n, k = 130, 256, 384
    a_q, a_s = ref.quantize_1x128(torch.randn(m, k))
    b = torch.randn(n, k)
    b_q, b_s = ref.quantize_128x128(b) if b_blocked else ref.quantize_1x128(b)
    outer = (lambda t: t.t().contiguous().t())
    want = fp8_gemm.triton_fp8_gemm(a_q, a_s, b_q, b_s, b_blocked, torch.float32)
    got = fp8_gemm.triton_fp8_gemm(a_q, outer(a_s), b_q, b_s if b_blocked else outer(b_s), b_blocked, torch.float32)
    assert outer(a_s).stride() == (1, m)
    assert torch.equal(got, want)


def test_gemm_rejects_mismatched_scales():
    a_q, a_s = ref.quantize_1x128(torch.randn(8, 256))
    b_q, b_s = ref.quantize_128x128(torch.randn(16, 256))
    with pytest.raises(ValueError, match="b scale"):
        fp8_gemm.triton_fp8_gemm(a_q, a_s, b_q, b_s, False, torch.float32)


def _assert_gemm_close(got: torch.Tensor, want: torch.Tensor, fp8: bool) -> None:
    """fp32 sums match the reference tightly; an FP8 GEMM on a GPU sums with the tensor cores'
    reduced precision (see test_triton_gemm_matches_the_dequantised_product), to ~1e-4 overall."""
    if fp8 and got.is_cuda:
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-3, rel
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.fixture
def reference_quantisers(monkeypatch):
    """The fused linear with the reference quantisers in place of the Triton ones (see module docstring)."""
    monkeypatch.setattr(fp8_gemm, "quantize_1x128", ref.quantize_1x128)
    monkeypatch.setattr(fp8_gemm, "quantize_128x128", ref.quantize_128x128)
    monkeypatch.setattr(fp8_gemm, "quantize_1x128_transposed", lambda x: ref.quantize_1x128(x.t().contiguous()))
    monkeypatch.setattr(fp8_gemm, "quantize_1x128_both",
                        lambda x: (*ref.quantize_1x128(x), *ref.quantize_1x128(x.t().contiguous())))


@pytest.mark.parametrize("shape", [(300, 520), (128, 256), (37, 130)])
def test_one_read_quantiser_is_the_separate_ones(shape):
    """``quantize_1x128_both`` gives bitwise what the separate quantisers give (the interpreter's e4m3 cast is the same wrong one in both; the GPU test
    compares them with the reference), partial tiles included."""
    torch.manual_seed(5)
    x = torch.randn(*shape) * torch.logspace(-3, 3, shape[1])
    q, s, q_t, s_t = fp8_gemm.quantize_1x128_both(x)
    for got, want in zip((q, s, q_t, s_t), (*fp8_gemm.quantize_1x128(x), *fp8_gemm.quantize_1x128_transposed(x))):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)


@pytest.mark.parametrize("gemms", [ALL_FP8, Fp8Gemms(fprop=False, dgrad=True, wgrad=False),
                                   Fp8Gemms(fprop=True, dgrad=False, wgrad=True), Fp8Gemms(False, False, False)],
                         ids=lambda g: "+".join(g.names()) or "none")
def test_fused_linear_autograd_matches_the_reference(reference_quantisers, gemms):
    """The fused op and the reference honour the same ``gemms``: FP8 GEMMs give the reference's
    numbers, GEMMs kept out of FP8 the exact ones (here fp32) -- the same numbers in both."""
    x, w, b = _linear_leaves(m=64, n=128, k=256)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear.fp8_linear(x, w, b, gemms=gemms)
    y_ref = ref.fp8_linear(xr, wr, br, gemms=gemms)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    _assert_gemm_close(y, y_ref, fp8=gemms.fprop)
    _assert_gemm_close(x.grad, xr.grad, fp8=gemms.dgrad)
    _assert_gemm_close(w.grad, wr.grad, fp8=gemms.wgrad)
    torch.testing.assert_close(b.grad, br.grad)
    # a GEMM kept out of FP8 is the plain product; one in FP8 is not
    x2, dy2 = xr.detach().reshape(-1, 256), dy.reshape(-1, 128)
    exact = {"fprop": (y_ref.reshape(-1, 128), x2 @ wr.detach().t() + br.detach()),
             "dgrad": (xr.grad.reshape(-1, 256), dy2 @ wr.detach()), "wgrad": (wr.grad, dy2.t() @ x2)}
    for name, (got, plain) in exact.items():
        if getattr(gemms, name):
            assert (got - plain).abs().max() > 1e-3 * plain.abs().max(), name
        else:
            torch.testing.assert_close(got, plain, rtol=1e-6, atol=1e-5)


def test_the_fused_op_and_the_reference_take_the_same_arguments():
    """One contract: the provider's ``fp8_linear``, the fused function and the reference have the
    same parameters and defaults (the caller's ``gemms``; no choice of their own)."""
    import inspect

    from loongforge.kernels import provider

    params = [[(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
              for fn in (provider.fp8_linear, fp8_linear.fp8_linear, ref.fp8_linear)]
    assert params[0] == params[1] == params[2]
    assert params[0][-1] == ("gemms", ALL_FP8)
    with pytest.raises(TypeError, match="gemms must be"):
        fp8_linear.fp8_linear(torch.randn(4, 8), torch.randn(6, 8), gemms=True)


def test_fp8_linear_rejects_bad_inputs():
    with pytest.raises(ValueError, match="weight"):
        ref.fp8_linear(torch.randn(4, 8), torch.randn(8, 6))
    with pytest.raises(ValueError, match="bias must be"):
        ref.fp8_linear(torch.randn(4, 8), torch.randn(6, 8), torch.randn(5))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        ref.fp8_linear(torch.randn(4, 8).to(torch.float8_e4m3fn), torch.randn(6, 8))
    with pytest.raises(TypeError, match="gemms must be"):
        ref.fp8_linear(torch.randn(4, 8), torch.randn(6, 8), gemms=("fprop",))


@pytest.mark.parametrize("dtype_in", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e5m2", [False, True])
@pytest.mark.parametrize("rows", [37, 64])
def test_cast_transpose_layouts_and_values(e5m2, rows, dtype_in):
    """Tensor-wise cast-transpose: both copies are the reference's, the transposed one padded
    with zeros to a multiple of 16 rows. The values are chosen on the FP8 grid times a power of
    two (so no rounding happens: the interpreter's fp8 cast mis-rounds across binades); the GPU
    test compares random values bitwise."""
    from loongforge.diffusion.ops.fp8_tensorwise import E4M3, E5M2, cast_transpose, tensor_scale
    from loongforge.kernels.fp8_cast import fp8_cast_transpose

    dtype = E5M2 if e5m2 else E4M3
    torch.manual_seed(0)
    grid = (torch.randn(rows, 160) * 50).clamp(-400, 400).to(dtype).float()
    grid[3, 7] = torch.finfo(dtype).max  # the amax: the scale is exactly 2^-4
    x = (grid * 2.0**-4).to(dtype_in)  # bf16 takes tl.trans, fp32 the second, column-order read
    scale = tensor_scale(x, dtype)
    assert scale.item() == 2.0**-4
    q, q_t = fp8_cast_transpose(x, scale, e5m2)
    want, want_t = cast_transpose(x, scale, e5m2)
    assert q.dtype == q_t.dtype == dtype and q_t.shape == (160, rows + (-rows % 16))
    assert torch.equal(q.float(), want.float()) and torch.equal(q_t.float(), want_t.float())


def test_cast_transpose_rejects_bad_inputs():
    from loongforge.kernels.fp8_cast import fp8_cast_transpose

    with pytest.raises(ValueError, match=r"expected a matrix and a scalar scale, got \(4, 4, 4\)"):
        fp8_cast_transpose(torch.zeros(4, 4, 4), torch.ones(()), False)
