"""The gradient arithmetic's pieces that need no megatron engine (the engine's are checked
against megatron in loongforge-llm's tests/test_precision_recipes.py)."""

import torch

from loongforge.core.training.grad_update import coalesced


def test_coalesced_joins_neighbours_in_one_storage_and_keeps_every_element_once():
    buffer = torch.randn(100)
    views = [buffer[0:10].view(2, 5), buffer[10:30], buffer[40:50], buffer[30:40], buffer[60:70]]
    strided = torch.randn(3, 4).t()  # not contiguous: kept as it is
    alone = torch.randn(7)
    out = coalesced([*views, strided, alone])
    shapes = sorted(tuple(t.shape) for t in out)
    assert shapes == [(4, 3), (7,), (10,), (50,)]  # 0..50 is one run; 60..70 sits after a gap
    squares = sum(float(t.double().square().sum()) for t in out)
    expected = sum(float(t.double().square().sum()) for t in [*views, strided, alone])
    assert abs(squares - expected) < 1e-9 * expected
    joined = next(t for t in out if t.numel() == 50)
    assert joined.data_ptr() == buffer.data_ptr() and torch.equal(joined, buffer[:50])


def test_coalesced_keeps_dtypes_apart():
    storage_f = torch.zeros(8)
    storage_h = torch.zeros(8, dtype=torch.bfloat16)
    out = coalesced([storage_f[:4], storage_h[:4], storage_f[4:], storage_h[4:]])
    assert sorted((str(t.dtype), t.numel()) for t in out) == [("torch.bfloat16", 8), ("torch.float32", 8)]
