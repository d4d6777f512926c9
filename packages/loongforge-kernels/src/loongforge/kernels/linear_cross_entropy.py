"""Fused linear + cross-entropy that never holds the full ``[N, V]`` logits (Triton + matmuls),
with its gradients computed in the forward.

Contract: ``loongforge.core.kernels.reference.linear_cross_entropy`` (per-token fp32 losses).
Tokens are processed in chunks (``token_chunk``: as many tokens as fit a logits budget, so the
weight gradient is accumulated over a few chunks rather than many). For each chunk one matmul
gives the logits ``[C, V]``; one Triton kernel reduces each row to its log-sum-exp (online softmax
over vocab blocks), emits the loss and, when a gradient is needed, overwrites the row in place with
``softmax - onehot`` (zero at ``ignore_index``); two matmuls then add the chunk's share of the
hidden-state gradient and of the weight gradient, for a unit gradient of every token's loss. So the
logits are computed once, not recomputed in the backward, as Liger's fused linear cross-entropy
does for a mean loss.

The backward scales those unit gradients by the losses' incoming gradient ``dloss``: row by row for
the hidden states (exact for any ``dloss``), and by one factor for the weight, which is exact when
``dloss`` is the same for every counted token -- the case of a loss that sums or averages the
per-token losses, which models make so by giving uncounted tokens ``ignore_index``. Any other
``dloss`` (per-token weights) is detected in the backward (one host read) and the weight gradient
is then recomputed chunk by chunk with the per-token factors: always exact, fast where it can be.

A caller that knows its loss weights every counted token alike passes ``uniform_grad=True``: the
backward then reads nothing back (a host read in the middle of the backward drains the queue of
launched kernels, and the GPU waits on the host for the rest of it): the factor is taken and
applied on the device, and a ``dloss`` that breaks the promise turns the weight gradient into NaN
(a non-finite step, which the training loop skips and reports), never into a wrong one. A label
outside the vocabulary then shows as a NaN loss rather than as an error raised here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loongforge.core.kernels.matmul import add_matmul
from loongforge.kernels.launch import check_tensors

BLOCK_VOCAB = 4096  # vocab entries per step of the per-row loops
SCALE_BLOCK = 4096  # elements per program of the weight gradient's scaling
CHUNK_LOGITS_BYTES = 256 * 2**20  # a chunk's logits buffer (bench/linear_ce_bench.py: 128 MiB costs 10% more time, 512 MiB 4% less)


@triton.jit
def _row_grad_in_place(base, n_vocab, label, lse, scale, BLOCK: tl.constexpr):
    """One row of logits at ``base`` becomes ``scale * (softmax - onehot(label))``."""
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)
        grad = tl.where(cols == label, p - 1.0, p) * scale
        tl.store(base + cols, grad.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _ce_forward(
    LOGITS, LABELS, LOSS, LSE,
    n_vocab, stride_logits, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_logits
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    label = tl.load(LABELS + row)
    ignored = label == ignore_index
    outside = (label < 0) | (label >= n_vocab)  # (the host reports it, at its next read: never read out of bounds)
    target = tl.load(base + tl.where(ignored | outside, 0, label)).to(tl.float32)
    tl.store(LOSS + row, tl.where(ignored, 0.0, tl.where(outside, float("nan"), lse - target)))
    tl.store(LSE + row, lse)
    if WRITE_GRAD:  # the row becomes softmax - onehot, the gradient of its loss (zero when ignored)
        _row_grad_in_place(base, n_vocab, label, lse, tl.where(ignored, 0.0, 1.0), BLOCK)


@triton.jit
def _ce_backward_in_place(
    LOGITS, LABELS, LSE, DLOSS,
    n_vocab, stride_logits, stride_dloss, ignore_index,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_logits
    label = tl.load(LABELS + row)
    lse = tl.load(LSE + row)
    scale = tl.where(label == ignore_index, 0.0, tl.load(DLOSS + row * stride_dloss).to(tl.float32))
    _row_grad_in_place(base, n_vocab, label, lse, scale, BLOCK)


def token_chunk(n_tokens: int, vocab: int, itemsize: int, budget: int = CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose ``[chunk, vocab]`` logits fit ``budget``
    bytes (at least 16 tokens), and no more than the tokens there are."""
    fits = max(budget // max(vocab * itemsize, 1), 16)
    return max(1, min(max(n_tokens, 1), 1 << (fits.bit_length() - 1)))


def _check(hidden, weight, labels, ignore_index):
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"linear_cross_entropy: expected hidden [N, H], weight [V, H], labels [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"linear_cross_entropy: shapes do not match: hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden dtype {hidden.dtype} != weight dtype {weight.dtype}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy: labels must be int64 or int32, got {labels.dtype}")
    check_tensors("linear_cross_entropy", hidden, weight, labels)


def _outside_label(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """``[any, label]``: whether a label is outside ``[0, vocab)`` without being ``ignore_index``, and
    the one of them farthest from zero (an int64 pair on the device: no read)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if not labels.numel():
        return labels.new_zeros(2, dtype=torch.int64)
    worst = torch.where(bad, labels, 0).long()
    return torch.stack([bad.any().long(), worst[worst.abs().argmax()]])


def _refuse_label(outside: list[int], vocab: int, ignore_index: int) -> None:
    if outside[0]:
        raise ValueError(f"linear_cross_entropy: label {outside[1]} is outside [0, {vocab}) and is not "
                         f"ignore_index={ignore_index}")


@triton.jit
def _scale_in_place(X, FACTOR, n, BLOCK: tl.constexpr):
    """``X *= FACTOR[0]`` (an fp32 factor on the device), one rounding to ``X``'s dtype."""
    factor = tl.load(FACTOR)
    if factor != 1.0:  # (a sum of the losses: nothing to do)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask).to(tl.float32)
        tl.store(X + offs, (x * factor).to(X.dtype.element_ty), mask=mask)


def _uniform_factor(dloss: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The one ``dloss`` of the counted tokens, as a 1-element fp32 tensor on the device: 0 where no
    token is counted (every unit gradient row is zero then), NaN where the counted tokens' ``dloss``
    differ (the caller broke ``uniform_grad``'s promise)."""
    counted = labels != ignore_index
    low = torch.where(counted, dloss, float("inf")).amin()
    high = torch.where(counted, dloss, float("-inf")).amax()
    return torch.where(low == high, high, torch.where(low > high, 0.0, float("nan"))).reshape(1)


def _chunks(n_tokens: int, chunk: int):
    for start in range(0, n_tokens, chunk):
        yield start, min(start + chunk, n_tokens)


def _accumulate(out: torch.Tensor, first: bool, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b`` for the first chunk, ``out += a @ b`` after it (the GEMM adds in place)."""
    if first:
        torch.mm(a, b, out=out)
    else:
        out.addmm_(a, b)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_bytes, grad_enabled, uniform_grad):
        _check(hidden, weight, labels, ignore_index)
        hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
        n_tokens, n_hidden = hidden.shape
        vocab = weight.shape[0]
        # (under no_grad, as in evaluation, needs_input_grad still follows requires_grad)
        need_hidden, need_weight = (grad_enabled and need for need in ctx.needs_input_grad[:2])
        grads = need_hidden or need_weight
        # labels outside the vocabulary: reported at the backward's one host read where it has one (the
        # weight gradient), else here (a read of its own); under uniform_grad, by the NaN loss alone
        ctx.uniform_grad = uniform_grad and need_weight and n_tokens > 0
        if not ctx.uniform_grad:
            ctx.outside = _outside_label(labels, vocab, ignore_index)
            if not (need_weight and n_tokens):
                _refuse_label(ctx.outside.tolist(), vocab, ignore_index)
        loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        # unit gradients: each token's loss with gradient 1 (the backward scales them)
        dhidden = torch.empty_like(hidden) if need_hidden else None
        dweight = torch.empty_like(weight) if need_weight else None
        chunk = token_chunk(n_tokens, vocab, hidden.element_size(), chunk_bytes)
        buf = torch.empty((min(chunk, n_tokens), vocab), dtype=hidden.dtype, device=hidden.device)
        for start, end in _chunks(n_tokens, chunk):
            logits = buf[: end - start]
            torch.mm(hidden[start:end], weight.t(), out=logits)
            _ce_forward[(end - start,)](
                logits, labels[start:end], loss[start:end], lse[start:end],
                vocab, logits.stride(0), ignore_index, WRITE_GRAD=grads, BLOCK=BLOCK_VOCAB, num_warps=8,
            )
            if need_hidden:
                torch.mm(logits, weight, out=dhidden[start:end])
            if need_weight:
                _accumulate(dweight, start == 0, logits.t(), hidden[start:end])
        if need_weight and n_tokens == 0:
            dweight.zero_()
        ctx.save_for_backward(hidden, weight, labels, lse, dhidden, dweight)
        ctx.ignore_index, ctx.chunk, ctx.used = ignore_index, chunk, False
        return loss

    @staticmethod
    def backward(ctx, dloss):
        if ctx.used:
            raise RuntimeError("linear_cross_entropy: its backward scales the gradients made in the forward in "
                               "place and runs once; run the forward again rather than retain_graph=True")
        ctx.used = True
        hidden, weight, labels, lse, dhidden, dweight = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dloss = dloss.float()
        if need_hidden:
            dhidden.mul_(dloss[:, None])  # row by row: exact for any dloss
        if need_weight and dloss.numel() and ctx.uniform_grad:  # no read: the factor applied on the device
            factor = _uniform_factor(dloss, labels, ctx.ignore_index)
            n = dweight.numel()
            _scale_in_place[(triton.cdiv(n, SCALE_BLOCK),)](dweight, factor, n, BLOCK=SCALE_BLOCK)
        elif need_weight and dloss.numel():
            counted = labels != ctx.ignore_index
            low = torch.where(counted, dloss, float("inf")).amin()
            high = torch.where(counted, dloss, float("-inf")).amax()
            low, high, *outside = torch.cat([torch.stack([low, high]).double(), ctx.outside.double()]).tolist()
            _refuse_label([int(v) for v in outside], weight.shape[0], ctx.ignore_index)  # (the op's one host read)
            if low < high:  # per-token factors: the weight gradient again, with them
                dweight = _weight_grad(hidden, weight, labels, lse, dloss, ctx.ignore_index, ctx.chunk)
            elif low == high and low != 1.0:  # one factor for every counted token
                dweight.mul_(low)
            # (low > high: no token is counted, and every unit gradient row was zero)
        return (dhidden if need_hidden else None, dweight if need_weight else None, None, None, None, None, None)


def _weight_grad(hidden, weight, labels, lse, dloss, ignore_index, chunk) -> torch.Tensor:
    """The weight gradient for per-token factors ``dloss``: each chunk's logits recomputed, turned
    into ``dloss * (softmax - onehot)`` in place, and accumulated (fp32 where it has to be added
    over several chunks)."""
    n_tokens = hidden.shape[0]
    vocab = weight.shape[0]
    several = n_tokens > chunk
    dweight = torch.zeros(weight.shape, dtype=torch.float32 if several else weight.dtype, device=weight.device)
    buf = torch.empty((min(chunk, n_tokens), vocab), dtype=hidden.dtype, device=hidden.device)
    for start, end in _chunks(n_tokens, chunk):
        dlogits = buf[: end - start]
        torch.mm(hidden[start:end], weight.t(), out=dlogits)
        _ce_backward_in_place[(end - start,)](
            dlogits, labels[start:end], lse[start:end], dloss[start:end],
            vocab, dlogits.stride(0), dloss.stride(0), ignore_index, BLOCK=BLOCK_VOCAB, num_warps=8,
        )
        add_matmul(dweight, dlogits.t(), hidden[start:end])
    return dweight.to(weight.dtype)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
    chunk_bytes: int = CHUNK_LOGITS_BYTES, uniform_grad: bool = False,
) -> torch.Tensor:
    """Fused ``loongforge.core.kernels.reference.linear_cross_entropy``: per-token fp32 losses.
    ``chunk_bytes``: the budget of one chunk's logits (``token_chunk``); ``uniform_grad``: the caller
    gives every counted token's loss the same gradient, so the backward reads nothing back (module
    docstring)."""
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_bytes, torch.is_grad_enabled(),
                                     uniform_grad)
