"""The vision MLP's output linear pads its GEMM width to 16 bytes: the same numbers as megatron's
``RowParallelLinear``, its GEMMs on the padded width, the parameter's shape unchanged."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import RowParallelLinear
from torch.profiler import ProfilerActivity, profile

from loongforge.vlm.encoders.aligned_linear import AlignedRowParallelLinear, padded_width


def _linear(cls, width: int, dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, params_dtype=dtype,
                            gradient_accumulation_fusion=False)
    return cls(width, 16, config=cfg, init_method=torch.nn.init.normal_, bias=True, input_is_parallel=True,
               skip_bias_add=False)


def _gemm_widths(fn) -> set[int]:
    """Every width the matmuls of ``fn()`` (forward and backward) reduce over or produce."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    widths = set()
    for event in prof.events():
        if event.name in ("aten::mm", "aten::addmm", "aten::matmul"):
            widths.update(d for shape in event.input_shapes if len(shape) == 2 for d in shape)
    return widths


@pytest.mark.parametrize("dtype, width, padded", [(torch.float32, 21, 24), (torch.bfloat16, 3420 // 60, 64)])
def test_aligned_linear_matches_row_parallel_linear(megatron_world, dtype, width, padded):
    assert padded_width(width, torch.tensor([], dtype=dtype).element_size()) == padded
    ours, ref = _linear(AlignedRowParallelLinear, width, dtype), _linear(RowParallelLinear, width, dtype)
    ref.load_state_dict(ours.state_dict())
    assert ours.weight.shape == (16, width)  # the parameter keeps its shape
    x = torch.randn(5, 2, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    dy = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for layer in (ours, ref):
        xi = x.clone().requires_grad_()
        widths = _gemm_widths(lambda: layer(xi)[0].backward(dy))
        results.append((layer(xi)[0].detach(), xi.grad, layer.weight.grad, layer.bias.grad, widths))
    (y, dx, dw, db, widths), (y_ref, dx_ref, dw_ref, db_ref, widths_ref) = results
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    torch.testing.assert_close(dw, dw_ref, **tol)
    torch.testing.assert_close(db, db_ref, **tol)
    assert padded in widths and width not in widths  # every GEMM ran on the padded width
    assert width in widths_ref


def test_aligned_width_is_left_alone(megatron_world):
    layer = _linear(AlignedRowParallelLinear, 32, torch.bfloat16)
    x = torch.randn(3, 1, 32, dtype=torch.bfloat16, requires_grad=True)
    assert 32 in _gemm_widths(lambda: layer(x)[0].sum().backward())
