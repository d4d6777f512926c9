"""The fused query/key RMSNorm + RoPE ops against their references (loongforge-diffusion's
``loongforge.diffusion.ops.qk_norm_rope``)."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels import OpWithBackward
from loongforge.diffusion.ops import qk_norm_rope as ref
from loongforge.diffusion.ops.attention_inputs import normed_rotated_qkv
from loongforge.kernels.qk_norm_rope import BACKWARD_ROWS, qk_norm_rope, qk_norm_rope_backward

from .conftest import compiled_on_gpu

EPS = 1e-6


def _inputs(tokens, heads, head_dim, dtype, seed=0, pad=0):
    """qkv ``[tokens, 3 * width]`` whose rows are ``pad`` elements apart beyond the width (a view of
    a wider projection output), norm weights and per-token angle tables."""
    g = torch.Generator().manual_seed(seed)
    width = heads * head_dim
    qkv = (torch.randn(tokens, 3 * width + pad, generator=g, device="cpu") * 2)[:, : 3 * width]
    weights = [1 + 0.5 * torch.randn(width, generator=g, device="cpu") for _ in range(2)]
    angles = torch.rand(tokens, head_dim // 2, generator=g, device="cpu") * 40
    device = torch.get_default_device()
    return (qkv.to(dtype).to(device), *(w.to(device) for w in weights),
            angles.cos().to(device), angles.sin().to(device))


def _grads(tokens, heads, head_dim, dtype, seed=1):
    """Gradients of q, k and v as attention hands them back: ``[tokens, heads, head_dim]``, the
    key's gradient with heads outermost in memory."""
    g = torch.Generator().manual_seed(seed)
    dq = torch.randn(tokens, heads, head_dim, generator=g, device="cpu")
    dk = torch.randn(heads, tokens, head_dim, generator=g, device="cpu").transpose(0, 1)
    dv = torch.randn(tokens, heads, head_dim, generator=g, device="cpu")
    device = torch.get_default_device()
    return tuple(t.to(dtype).to(device) for t in (dq, dk, dv))


# fp32: a few ulps (summation order); bf16: one rounding step of the output
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, head_dim, pad", [(37, 3, 16, 5), (5, 2, 8, 0), (64, 12, 8, 0)])
def test_forward_equals_reference(dtype, tokens, heads, head_dim, pad):
    qkv, wq, wk, cos, sin = _inputs(tokens, heads, head_dim, dtype, pad=pad)
    q, k = qk_norm_rope(qkv, wq, wk, cos, sin, EPS)
    want_q, want_k = ref.qk_norm_rope(qkv, wq, wk, cos, sin, EPS)
    assert q.dtype == k.dtype == dtype and q.shape == k.shape == (tokens, heads * head_dim)
    torch.testing.assert_close(q, want_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, want_k, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the last: several row blocks per program, so the running weight-gradient sums add up
@pytest.mark.parametrize("tokens, heads, head_dim, pad", [(37, 3, 16, 5), (5, 2, 8, 0), (BACKWARD_ROWS * 300 + 3, 2, 8, 0)])
def test_backward_equals_reference(dtype, tokens, heads, head_dim, pad):
    qkv, wq, wk, cos, sin = _inputs(tokens, heads, head_dim, dtype, pad=pad)
    dq, dk, dv = _grads(tokens, heads, head_dim, dtype)
    dqkv, dweights = qk_norm_rope_backward(dq, dk, dv, qkv, wq, wk, cos, sin, EPS)
    want_dqkv, want_dweights = ref.qk_norm_rope_backward(dq, dk, dv, qkv, wq, wk, cos, sin, EPS)
    width = heads * head_dim
    assert dqkv.dtype == dtype and dqkv.shape == (tokens, 3 * width) and dweights.dtype == torch.float32
    torch.testing.assert_close(dqkv, want_dqkv, **TOLERANCE[dtype])
    assert torch.equal(dqkv[:, 2 * width :], dv.reshape(tokens, width))  # the values' gradient is copied
    # bf16: the rotation's gradient is rounded before the sums, one step up or down per element
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1 * tokens**0.5, "rtol": 1e-2}
    torch.testing.assert_close(dweights, want_dweights, **tol)


def test_the_function_equals_autograd_of_the_ops():
    """``normed_rotated_qkv`` with the fused ops: values, the input gradient and both weight
    gradients equal autograd through diffusers-style RMSNorm and interleaved RoPE (fp32)."""
    tokens, heads, head_dim = 29, 4, 8
    qkv, wq, wk, cos, sin = _inputs(tokens, heads, head_dim, torch.float32)
    dq, dk, dv = _grads(tokens, heads, head_dim, torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in (qkv, wq, wk)]
    fused = normed_rotated_qkv(*leaves, cos, sin, EPS, OpWithBackward(qk_norm_rope, qk_norm_rope_backward))
    torch.autograd.backward(fused, [t.reshape(tokens, -1) for t in (dq, dk, dv)])
    fused_grads = [t.grad for t in leaves]

    x, w_q, w_k = (t.detach().clone().requires_grad_() for t in (qkv, wq, wk))
    width = heads * head_dim
    outputs = []
    for i, w in enumerate((w_q, w_k)):
        y = torch.nn.functional.rms_norm(x[:, i * width : (i + 1) * width], (width,), w, EPS)
        a, b = y.unflatten(1, (heads, head_dim // 2, 2)).unbind(-1)
        c, s = cos[:, None], sin[:, None]
        outputs.append(torch.stack((a * c - b * s, a * s + b * c), -1).flatten(1))
    outputs.append(x[:, 2 * width :])
    torch.autograd.backward(outputs, [t.reshape(tokens, -1) for t in (dq, dk, dv)])
    for got, want in zip(fused, outputs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(fused_grads, (x.grad, w_q.grad, w_k.grad)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_fake_outputs_match_the_real_ones():
    """The meta versions that compiled graphs are built from give the real ops' shapes, dtypes and
    (row-major) strides, for strided gradient inputs too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = _inputs(12, 2, 8, torch.bfloat16, pad=3)
    grads = _grads(12, 2, 8, torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) for t in real]
        fake_grads = [mode.from_tensor(t) for t in grads]
        fake_outs = (*torch.ops.loongforge.qk_norm_rope(*fake, EPS),
                     *torch.ops.loongforge.qk_norm_rope_backward(*fake_grads, *fake, EPS))
    real_outs = (*qk_norm_rope(*real, EPS), *qk_norm_rope_backward(*grads, *real, EPS))
    for f, r in zip(fake_outs, real_outs):
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


@pytest.mark.parametrize("change, match", [
    (lambda a: (a[0][:, :-1], *a[1:]), r"expected qkv \[tokens, 3 \* width\] .*; got qkv \(6, 95\)"),
    (lambda a: (a[0], a[1][:-1], *a[2:]), r"q_weight \[width\], k_weight \[width\].*; got \(6, 96\), \(31,\), \(32,\)"),
    (lambda a: (*a[:3], a[3][:, :3], a[4][:, :3]), r"heads of 2 \* 3 channels"),
    (lambda a: (*a[:3], a[3][:-1], a[4]), r"cos \[tokens, pairs\], sin \[tokens, pairs\]; got .*\(5, 8\), \(6, 8\)"),
])
def test_bad_inputs_name_what_is_wrong(change, match):
    args = _inputs(6, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=match):
        qk_norm_rope(*change(args), EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not compiled_on_gpu(), reason="model shapes run with the compiled kernels on a GPU")
def test_wan_shape_on_gpu():
    """Wan-1.3B's self-attention (12 heads x 128, width 1536) at 14040 tokens, qkv a GEMM output."""
    tokens, heads, head_dim = 14040, 12, 128
    qkv, wq, wk, cos, sin = _inputs(tokens, heads, head_dim, torch.bfloat16)
    dq, dk, dv = _grads(tokens, heads, head_dim, torch.bfloat16)
    for got, want in zip(qk_norm_rope(qkv, wq, wk, cos, sin, EPS), ref.qk_norm_rope(qkv, wq, wk, cos, sin, EPS)):
        torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])
    dqkv, dweights = qk_norm_rope_backward(dq, dk, dv, qkv, wq, wk, cos, sin, EPS)
    want_dqkv, want_dweights = ref.qk_norm_rope_backward(dq, dk, dv, qkv, wq, wk, cos, sin, EPS)
    torch.testing.assert_close(dqkv, want_dqkv, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(dweights, want_dweights, atol=0.1 * tokens**0.5, rtol=1e-2)
