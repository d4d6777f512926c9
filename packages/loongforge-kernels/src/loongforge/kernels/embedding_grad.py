"""An embedding table's gradient added into an existing buffer, the looked-up rows alone (Triton).

Contract: ``loongforge.core.kernels.reference.embedding_grad_add``. The token ids are sorted (a
stable sort: the tokens of one id keep their order); the program at the first position of each
id's run sums that run's gradient rows in fp32, ``RUN_ROWS`` rows at a time in a fixed order (a
frequent token's run of hundreds of rows is a few dozen dependent steps, not hundreds), and adds
the sum into the id's row of the buffer, rounding once. Every row is written by one program, so the result is deterministic;
rows no token looked up are not touched. The ids must lie in ``[0, vocab)`` (unchecked here: the
embedding's forward lookup has checked them). A 128k-vocabulary table costs a pass over the tokens'
gradients, not the zero fill, the dense ``[vocab, hidden]`` gradient and its add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.kernels.launch import check_tensors

BLOCK_COLS = 1024  # columns per program
RUN_ROWS = 8  # gradient rows of one run loaded and summed together


@triton.jit
def _embedding_grad_add(SORTED, ORDER, RUN_END, DY, OUT, n_tokens, n_cols, stride_dy, stride_out,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr):
    pos = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    row = tl.load(SORTED + pos)
    before = tl.load(SORTED + pos - 1, mask=pos > 0, other=0)
    if (pos == 0) | (row != before):  # the first token of its id's run
        end = tl.load(RUN_END + pos)
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for j in range(pos, end, ROWS):
            at = j + tl.arange(0, ROWS)
            inside = at < end
            tokens = tl.load(ORDER + at, mask=inside, other=0).to(tl.int64)
            acc += tl.load(DY + tokens[:, None] * stride_dy + cols[None, :], mask=inside[:, None] & mask[None, :],
                           other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=0)
        target = OUT + row.to(tl.int64) * stride_out + cols
        old = tl.load(target, mask=mask, other=0.0).to(tl.float32)
        tl.store(target, (old + total).to(OUT.dtype.element_ty), mask=mask)


def embedding_grad_add(table_grad: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor) -> None:
    """Fused ``loongforge.core.kernels.reference.embedding_grad_add``."""
    check_tensors("embedding_grad_add", table_grad, ids, dy)
    if table_grad.dim() != 2 or table_grad.stride(-1) != 1:
        raise ValueError(f"embedding_grad_add: the table's gradient must be a 2-D row-major buffer, got shape "
                         f"{tuple(table_grad.shape)} strides {table_grad.stride()}")
    n_cols = table_grad.shape[1]
    if dy.shape[-1] != n_cols or dy.numel() != ids.numel() * n_cols:
        raise ValueError(f"embedding_grad_add: gradient of shape {tuple(dy.shape)} for {ids.numel()} ids into a "
                         f"table of {n_cols} columns")
    flat_ids = ids.reshape(-1)
    rows = dy.reshape(-1, n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = flat_ids.numel()
    if n == 0:
        return
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    block = min(BLOCK_COLS, triton.next_power_of_2(n_cols))
    _embedding_grad_add[(n, triton.cdiv(n_cols, block))](
        sorted_ids, order, run_end, rows, table_grad, n, n_cols, rows.stride(0), table_grad.stride(0),
        BLOCK=block, ROWS=RUN_ROWS, num_warps=4,
    )
