"""Packed attention's query chunking: many queries against few keys run as a batch of chunks."""

import pytest
import torch
import torch.nn.functional as F

from loongforge.diffusion.model.attention import packed_attention, query_chunks


def test_chunk_counts():
    assert query_chunks(14040, 512) == 8  # a 480x832x33 video against a 512-token prompt
    assert query_chunks(2047, 512) == 1  # fewer than 4x the keys: one call
    assert query_chunks(2048, 512) == 2 and query_chunks(5000, 512) == 4


@pytest.mark.parametrize("tq", [203, 160])  # 203: the last chunk is padded
def test_chunked_queries_equal_one_call(tq):
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 2, 16, dtype=torch.float64, requires_grad=True) for n in (tq, 40, 40))
    assert query_chunks(tq, 40) == 2
    out = packed_attention(q, k, v, [0, tq], [0, 40], "split")
    want = F.scaled_dot_product_attention(*(t.detach().transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in leaves)).transpose(0, 1).backward(dout)
    for got, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad, ref.grad, atol=1e-12, rtol=1e-12)
