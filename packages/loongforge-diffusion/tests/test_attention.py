"""Packed attention's query chunking: many queries against few keys run as a batch of chunks."""

import pytest
import torch
import torch.nn.functional as F

from loongforge.diffusion.model.attention import packed_attention
from loongforge.diffusion.model.query_chunks import query_chunks


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


def test_cudnn_backend_needs_cuda_half_tensors():
    q = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="'cudnn' needs CUDA fp16/bf16"):
        packed_attention(q, q, q, [0, 4, 10], [0, 4, 10], "cudnn")


def test_auto_runs_packs_on_cudnn_only_where_prepared_for_it():
    from loongforge.diffusion.model.attention import CUDNN_MIN_MEAN_SEGMENT, Segments, resolve_backend

    long = Segments([0, CUDNN_MIN_MEAN_SEGMENT, 2 * CUDNN_MIN_MEAN_SEGMENT])
    assert not long.prefer_cudnn  # only prepare(device) decides, on the device it runs on
    q = torch.empty(0, dtype=torch.bfloat16)
    assert resolve_backend("auto", q, long, long) == "split"  # not a CUDA tensor
    one = Segments([0, 10])
    assert resolve_backend("auto", q, one, one) == "split"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention needs a CUDA device")
@pytest.mark.parametrize("q_bounds,k_bounds", [
    ([0, 300, 1000, 1029], [0, 300, 1000, 1029]),  # self-attention over a pack, a short last segment
    ([0, 701, 2100], [0, 64, 128]),  # video tokens against prompts: chunked queries, a padded chunk
])
def test_cudnn_backend_equals_split_on_gpu(q_bounds, k_bounds):
    """The per-segment cuDNN op (forward and its own backward) equals one SDPA call per segment."""
    from loongforge.diffusion.model.attention import Segments

    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n in (q_bounds[-1], k_bounds[-1], k_bounds[-1]))
    assert query_chunks(1399, 64) == 8 and 1399 % 8
    qs, ks = Segments(q_bounds), Segments(k_bounds)
    qs.prepare("cuda")
    ks.prepare("cuda")
    out = packed_attention(q, k, v, qs, ks, "cudnn")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want = packed_attention(*leaves, q_bounds, k_bounds, "split")
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout)
    for got, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.float(), ref.grad.float(), atol=3e-2, rtol=3e-2)
