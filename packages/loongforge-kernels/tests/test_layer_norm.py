"""The fused adaLN LayerNorm ops against their references (``core.kernels.layer_norm``)."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels import layer_norm as ref
from loongforge.kernels.layer_norm import BACKWARD_ROWS, modulated_layer_norm, modulated_layer_norm_backward

from .conftest import compiled_on_gpu

EPS = 1e-6
# fp32: a few ulps (summation order); bf16: one rounding step of the output
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 1.6e-2}}


def _inputs(tokens, width, rows, dtype, seed=0, pad=0):
    """x ``[tokens, width]`` (rows ``pad`` elements apart beyond the width), a transform of
    ``rows`` rows (1: shared) taken as views of a wider table, and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, width + pad, generator=g) * 3 + 1)[:, :width]
    table = torch.randn(rows, 3, width, generator=g)  # like a [tokens, 6, width] modulation table
    weight, bias = 1 + 0.3 * table[:, 0], table[:, 1]
    dy = torch.randn(tokens, width, generator=g)
    device = torch.get_default_device()
    return x.to(dtype).to(device), weight.to(device), bias.to(device), dy.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
# the last: several row blocks per program, so the running sums of the shared case add up
@pytest.mark.parametrize("tokens, width, pad", [(37, 48, 5), (3, 40, 0), (BACKWARD_ROWS * 300 + 3, 24, 0)])
def test_forward_and_backward_equal_reference(dtype, per_token, tokens, width, pad):
    x, weight, bias, dy = _inputs(tokens, width, tokens if per_token else 1, dtype, pad=pad)
    y = modulated_layer_norm(x, weight, bias, EPS)
    assert y.dtype == dtype and y.shape == (tokens, width)
    torch.testing.assert_close(y, ref.modulated_layer_norm(x, weight, bias, EPS), **TOLERANCE[dtype])
    got = modulated_layer_norm_backward(dy, x, weight, bias, EPS)
    want = ref.modulated_layer_norm_backward(dy, x, weight, bias, EPS)
    assert got[0].dtype == dtype and got[1].shape == got[2].shape == weight.shape
    torch.testing.assert_close(got[0], want[0], **TOLERANCE[dtype])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)


def test_fake_outputs_match_the_real_ones():
    """The meta versions that compiled graphs are built from give the real ops' shapes, dtypes
    and strides, shared and per token."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for rows in (1, 12):
        real = _inputs(12, 40, rows, torch.bfloat16, pad=3)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            x, w, b, dy = (mode.from_tensor(t) for t in real)
            fake = (torch.ops.loongforge.modulated_layer_norm(x, w, b, EPS),
                    *torch.ops.loongforge.modulated_layer_norm_backward(dy, x, w, b, EPS))
        x, w, b, dy = real
        outs = (modulated_layer_norm(x, w, b, EPS), *modulated_layer_norm_backward(dy, x, w, b, EPS))
        for f, r in zip(fake, outs):
            assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


def test_rows_must_be_contiguous():
    x, weight, bias, _ = _inputs(6, 16, 1, torch.float32)
    with pytest.raises(ValueError, match="x needs contiguous rows"):
        modulated_layer_norm(x.t().contiguous().t(), weight, bias, EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not compiled_on_gpu(), reason="model shapes run with the compiled kernels on a GPU")
@pytest.mark.parametrize("per_token", [False, True])
def test_wan_shape_on_gpu(per_token):
    """Wan-1.3B's width 1536 at 14040 tokens (a 33x480x832 video), bf16."""
    tokens = 14040
    x, weight, bias, dy = _inputs(tokens, 1536, tokens if per_token else 1, torch.bfloat16)
    torch.testing.assert_close(modulated_layer_norm(x, weight, bias, EPS), ref.modulated_layer_norm(x, weight, bias, EPS),
                               **TOLERANCE[torch.bfloat16])
    got = modulated_layer_norm_backward(dy, x, weight, bias, EPS)
    want = ref.modulated_layer_norm_backward(dy, x, weight, bias, EPS)
    torch.testing.assert_close(got[0], want[0], **TOLERANCE[torch.bfloat16])
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-4)
