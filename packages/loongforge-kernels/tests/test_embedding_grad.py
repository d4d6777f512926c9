"""The fused embedding gradient add vs the torch reference and autograd (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels import reference
from loongforge.kernels.embedding_grad import embedding_grad_add


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_grad_add_equals_the_reference_and_autograds_dense_gradient(dtype):
    torch.manual_seed(0)
    vocab, hidden = 23, 40  # hidden below one block: masked columns
    ids = torch.tensor([[5, 1, 5, 22, 0], [5, 9, 1, 0, 17]])
    dy = torch.randn(2, 5, hidden, dtype=dtype)
    start = torch.randn(vocab, hidden, dtype=dtype)
    fused, ref = start.clone(), start.clone()
    embedding_grad_add(fused, ids, dy)
    reference.embedding_grad_add(ref, ids, dy)
    # the same fp32 sums, rounded once (bf16: within one unit of the last place, as the interpreter
    # and torch may round the last bit differently)
    torch.testing.assert_close(fused, ref, **(dict(rtol=8e-3, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=0)))
    table = torch.zeros(vocab, hidden, dtype=torch.float32, requires_grad=True)
    torch.nn.functional.embedding(ids, table).backward(dy.float())
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.float(), start.float() + table.grad, **tol)
    untouched = [i for i in range(vocab) if i not in ids]
    assert torch.equal(fused[untouched], start[untouched])


def test_embedding_grad_add_over_column_blocks_and_strided_gradients():
    torch.manual_seed(1)
    vocab, hidden = 7, 1500  # two column blocks, the second partial
    ids = torch.randint(0, vocab, (3, 4))
    dy = torch.randn(4, 3, hidden).transpose(0, 1)  # not contiguous
    start = torch.randn(vocab, hidden)
    fused, ref = start.clone(), start.clone()
    embedding_grad_add(fused, ids, dy)
    reference.embedding_grad_add(ref, ids, dy)
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=1e-6)


def test_embedding_grad_add_sums_a_long_run_of_one_token():
    """A frequent token (a run longer than the rows summed at once) among rare ones."""
    torch.manual_seed(2)
    vocab, hidden = 9, 64
    ids = torch.randint(0, vocab, (70,))
    ids[::2] = 4
    dy = torch.randn(70, hidden)
    start = torch.randn(vocab, hidden)
    fused, ref = start.clone(), start.clone()
    embedding_grad_add(fused, ids, dy)
    reference.embedding_grad_add(ref, ids, dy)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


def test_embedding_grad_add_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="embedding_grad_add: gradient of shape"):
        embedding_grad_add(torch.zeros(5, 8), torch.tensor([1, 2]), torch.zeros(3, 8))
