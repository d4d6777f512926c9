"""The fused adaLN LayerNorm ops against their references (``loongforge.diffusion.ops.layer_norm``)."""

from __future__ import annotations

import pytest
import torch

from loongforge.diffusion.ops import layer_norm as ref
from loongforge.kernels.layer_norm import BACKWARD_ROWS, modulated_layer_norm, modulated_layer_norm_backward

from .conftest import compiled_on_gpu

EPS = 1e-6
# fp32: a few ulps (summation order); bf16: one rounding step of the output
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 1.6e-2}}


def _inputs(tokens, width, samples, dtype, seed=0, pad=0):
    """x ``[tokens, width]`` (rows ``pad`` elements apart beyond the width); a transform of
    ``samples`` rows taken as views of a ``[samples, 6, width]`` modulation table, and the sample
    of each token (None for one sample; else contiguous runs, one sample twice); an output gradient."""
    g = torch.Generator().manual_seed(seed)  # CPU draws (the GPU tests run with cuda as the default device)
    x = (torch.randn(tokens, width + pad, generator=g, device="cpu") * 3 + 1)[:, :width]
    table = torch.randn(samples, 6, width, generator=g, device="cpu")
    weight, bias = 1 + 0.3 * table[:, 1], table[:, 0]
    index = None
    if samples > 1:
        cuts = torch.linspace(0, tokens, samples + 2).long()
        index = torch.cat([torch.full((int(cuts[i + 1] - cuts[i]),), i % samples) for i in range(samples + 1)])
    dy = torch.randn(tokens, width, generator=g, device="cpu")
    device = torch.get_default_device()
    return (x.to(dtype).to(device), weight.to(device), bias.to(device),
            None if index is None else index.to(device), dy.to(dtype).to(device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("samples", [1, 3])
# the last: several row blocks per program, so the running sums add up
@pytest.mark.parametrize("tokens, width, pad", [(37, 48, 5), (4, 40, 0), (BACKWARD_ROWS * 300 + 3, 24, 0)])
def test_forward_and_backward_equal_reference(dtype, samples, tokens, width, pad):
    x, weight, bias, index, dy = _inputs(tokens, width, samples, dtype, pad=pad)
    y = modulated_layer_norm(x, weight, bias, EPS, index)
    assert y.dtype == dtype and y.shape == (tokens, width)
    torch.testing.assert_close(y, ref.modulated_layer_norm(x, weight, bias, EPS, index), **TOLERANCE[dtype])
    got = modulated_layer_norm_backward(dy, x, weight, bias, EPS, index)
    want = ref.modulated_layer_norm_backward(dy, x, weight, bias, EPS, index)
    assert got[0].dtype == dtype and got[1].shape == got[2].shape == weight.shape
    torch.testing.assert_close(got[0], want[0], **TOLERANCE[dtype])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)


def test_any_token_order():
    """Samples interleaved token by token: every row changes the sample, the partial sums still add up."""
    x, weight, bias, _, dy = _inputs(50, 32, 4, torch.float32)
    index = torch.arange(50, device=x.device) % 4
    got = modulated_layer_norm_backward(dy, x, weight, bias, EPS, index)
    want = ref.modulated_layer_norm_backward(dy, x, weight, bias, EPS, index)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)


def test_fake_outputs_match_the_real_ones():
    """The meta versions that compiled graphs are built from give the real ops' shapes, dtypes
    and strides, with and without an index."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for samples in (1, 3):
        real = _inputs(12, 40, samples, torch.bfloat16, pad=3)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            x, w, b, index, dy = (None if t is None else mode.from_tensor(t) for t in real)
            fake = (torch.ops.loongforge.modulated_layer_norm(x, w, b, EPS, index),
                    *torch.ops.loongforge.modulated_layer_norm_backward(dy, x, w, b, EPS, index))
        x, w, b, index, dy = real
        outs = (modulated_layer_norm(x, w, b, EPS, index), *modulated_layer_norm_backward(dy, x, w, b, EPS, index))
        for f, r in zip(fake, outs):
            assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


def test_rows_must_be_contiguous():
    x, weight, bias, _, _ = _inputs(6, 16, 1, torch.float32)
    with pytest.raises(ValueError, match="x needs contiguous rows"):
        modulated_layer_norm(x.t().contiguous().t(), weight, bias, EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not compiled_on_gpu(), reason="model shapes run with the compiled kernels on a GPU")
@pytest.mark.parametrize("samples", [1, 3])
def test_wan_shape_on_gpu(samples):
    """Wan-1.3B's width 1536 at 14040 tokens (a 33x480x832 video, or a pack of three), bf16."""
    x, weight, bias, index, dy = _inputs(14040, 1536, samples, torch.bfloat16)
    torch.testing.assert_close(modulated_layer_norm(x, weight, bias, EPS, index),
                               ref.modulated_layer_norm(x, weight, bias, EPS, index), **TOLERANCE[torch.bfloat16])
    got = modulated_layer_norm_backward(dy, x, weight, bias, EPS, index)
    want = ref.modulated_layer_norm_backward(dy, x, weight, bias, EPS, index)
    torch.testing.assert_close(got[0], want[0], **TOLERANCE[torch.bfloat16])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-4)


def test_compiled_with_an_index_equals_eager():
    """The fused ops (custom ops with an optional index) inside a compiled graph, dynamic token
    counts: the value and every gradient equal the eager function's."""
    from loongforge.core.kernels import OpWithBackward
    from loongforge.diffusion.ops.modulated_norm import normalize_and_modulate

    kernels = OpWithBackward(modulated_layer_norm, modulated_layer_norm_backward)

    def loss(x, table, index):
        shift, scale = table.unbind(1)
        return (normalize_and_modulate(x, 1 + scale, shift, EPS, kernels, index) * x).sum()

    compiled = torch.compile(loss, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (20, 31):
        x, weight, _, index, _ = _inputs(tokens, 32, 3, torch.float32, seed=tokens)
        table = torch.stack((weight - 1, weight), dim=1)
        results = []
        for fn in (loss, compiled):
            leaves = [t.clone().requires_grad_() for t in (x, table)]
            value = fn(*leaves, index)
            value.backward()
            results.append((value.detach(), *(t.grad for t in leaves)))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
