"""The feed-forward's fused GELU ops against their references (``loongforge.diffusion.ops.gelu``).

On CPU they run in Triton's interpreter, whose fp32 -> e4m3 cast mis-rounds across binades (see
test_fp8.py), so there the GELU cast is compared with the plain cast kernel applied to the
reference GELU; on a GPU it is compared with the reference itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongforge.diffusion.ops import gelu as ref
from loongforge.diffusion.ops.feed_forward import FeedForwardKernels, gelu_feed_forward
from loongforge.kernels.fp8_cast import fp8_cast_transpose
from loongforge.kernels.gelu import (
    BLOCK_M, BLOCK_N, gelu_fp8_cast_transpose, gelu_tanh_backward, gelu_tanh_backward_in_place,
)

from .conftest import compiled_on_gpu


def _hidden(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, cols, generator=g, device="cpu") * 3  # well into both tails of the GELU
    dg = torch.randn(rows, cols, generator=g, device="cpu")
    return h.to(dtype).to(torch.get_default_device()), dg.to(dtype).to(torch.get_default_device())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (200, 40) and the last: several row tiles per program, so the running column sums add up
@pytest.mark.parametrize("rows, cols", [(2 * BLOCK_M + 5, BLOCK_N + 44), (3, 40), (200, 40), (BLOCK_M * 50 + 3, BLOCK_N + 44)])
def test_gelu_tanh_backward_equals_reference(dtype, rows, cols):
    h, dg = _hidden(rows, cols, dtype)
    dh, db, amax, g = gelu_tanh_backward(dg, h, True)
    want_dh, want_db, want_amax, want_g = ref.gelu_tanh_backward(dg, h, True)
    assert dh.dtype == g.dtype == dtype and db.dtype == amax.dtype == torch.float32
    # fp32: a few ulps (tanh through exp2); bf16: one rounding step of the output
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(dh, want_dh, **tol)
    torch.testing.assert_close(g, want_g, **tol)
    torch.testing.assert_close(db, want_db, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(amax, want_amax, atol=0, rtol=1e-5)
    assert gelu_tanh_backward(dg, h, False)[3].numel() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(2 * BLOCK_M + 5, BLOCK_N + 44), (3, 40)])
@pytest.mark.parametrize("layout", ["row_major", "transposed"])
def test_gelu_tanh_backward_in_place_equals_reference(dtype, rows, cols, layout):
    """``dg`` overwritten with the reference's ``dh`` (a ``dg`` that is not row-major too), the
    bias gradient returned; ``h`` untouched."""
    h, dg = _hidden(rows, cols, dtype)
    if layout == "transposed":  # the same values in a column-major buffer
        dg = dg.t().contiguous().t()
    h_before, want_dg = h.clone(), dg.clone()
    want_db = ref.gelu_tanh_backward_in_place(want_dg, h)
    got_db = gelu_tanh_backward_in_place(dg, h)
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(dg, want_dg, **tol)
    torch.testing.assert_close(got_db, want_db, atol=1e-4, rtol=1e-5)
    assert torch.equal(h, h_before) and dg.stride() == want_dg.stride()
    # the reference's dh is the out-of-place op's
    torch.testing.assert_close(want_dg, ref.gelu_tanh_backward(*_hidden(rows, cols, dtype)[::-1], False)[0], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [37, 64, 130])
def test_gelu_fp8_cast_transpose_is_the_cast_of_gelu(rows, dtype):
    h, _ = _hidden(rows, 96, dtype, seed=2)
    q, q_t, scale = gelu_fp8_cast_transpose(h)
    want_q, want_t, want_scale = ref.gelu_fp8_cast_transpose(h)
    torch.testing.assert_close(scale, want_scale, atol=0, rtol=1e-6)
    assert q.shape == want_q.shape and q_t.shape == want_t.shape == (96, rows + (-rows % 16))
    if compiled_on_gpu():  # torch's tanh against exp2: a value next to a rounding midpoint may differ
        for got, want in ((q, want_q), (q_t, want_t)):
            codes = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
            assert codes.max() <= 1 and (codes == 0).float().mean() > 0.999
    else:  # the interpreter's cast of the reference GELU, scaled the same
        plain_q, plain_t = fp8_cast_transpose(F.gelu(h.float(), approximate="tanh"), scale, False)
        assert torch.equal(q.float(), plain_q.float()) and torch.equal(q_t.float(), plain_t.float())
    assert torch.equal(q_t[:, :rows].float(), q.t().float()) and not q_t[:, rows:].float().any()


def test_fused_feed_forward_equals_the_reference_ops():
    """gelu_feed_forward with the Triton ops (FP8 and not) equals it with the references. In the
    interpreter the FP8 casts stay the references' (its e4m3 rounding is not the GPU's), so the
    fused GELU backward is checked inside the FP8 feed-forward as well."""
    from loongforge.core.kernels import get_op

    torch.manual_seed(0)
    device = torch.get_default_device()
    x = torch.randn(50, 32, device=device)
    params = [torch.randn(s, device=device) / s[-1] ** 0.5 for s in ((64, 32), (64,), (48, 64), (48,))]
    reference_casts = (get_op("fp8_cast_transpose").reference, get_op("gelu_fp8_cast_transpose").reference)
    casts = (fp8_cast_transpose, gelu_fp8_cast_transpose) if compiled_on_gpu() else reference_casts
    fused = (gelu_tanh_backward, gelu_tanh_backward_in_place)
    reference = (get_op("gelu_tanh_backward").reference, get_op("gelu_tanh_backward_in_place").reference)
    cases = {False: (FeedForwardKernels(*fused), FeedForwardKernels(*reference)),
             True: (FeedForwardKernels(*fused, *casts), FeedForwardKernels(*reference, *reference_casts))}
    for fp8, kernel_sets in cases.items():
        results = []
        for kernels in kernel_sets:
            xs = x.clone().requires_grad_()
            ps = [p.clone().requires_grad_() for p in params]
            y = gelu_feed_forward(xs, *ps, kernels)
            y.backward(torch.linspace(-1, 1, y.numel(), device=device).view_as(y))
            results.append([y.detach(), xs.grad, *(p.grad for p in ps)])
        for got, want in zip(*results):
            if fp8 and compiled_on_gpu():  # an element may round to the next e4m3 value
                assert ((got - want).norm() / want.norm()).item() < 0.02
            else:
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"gelu_tanh_backward: expected non-empty matrices, got \(0, 4\)"):
        gelu_tanh_backward(torch.zeros(0, 4), torch.zeros(0, 4), False)
    with pytest.raises(ValueError, match=r"gelu_tanh_backward: expected matrices of one shape"):
        gelu_tanh_backward(torch.zeros(4, 4), torch.zeros(4, 5), False)
    with pytest.raises(ValueError, match=r"gelu_fp8_cast_transpose: expected matrices of one shape, got \[\(2, 3, 4\)\]"):
        gelu_fp8_cast_transpose(torch.zeros(2, 3, 4))


def test_fake_outputs_match_the_real_ones_for_strided_inputs():
    """What compiled graphs assume about the ops' outputs (shapes, dtypes, strides) holds for
    transposed inputs too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    h, dg = (t.t() for t in _hidden(40, 24, torch.bfloat16))  # [24, 40], column-major
    real = [*torch.ops.loongforge.gelu_tanh_backward(dg, h, True), *torch.ops.loongforge.gelu_fp8_cast_transpose(h)]
    with FakeTensorMode() as mode:
        fake_h, fake_dg = mode.from_tensor(h), mode.from_tensor(dg)
        fake = [*torch.ops.loongforge.gelu_tanh_backward(fake_dg, fake_h, True),
                *torch.ops.loongforge.gelu_fp8_cast_transpose(fake_h)]
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
