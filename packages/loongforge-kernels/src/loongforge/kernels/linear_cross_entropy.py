"""Fused linear + cross-entropy that never holds the full ``[N, V]`` logits (Triton + matmuls).

Contract: ``loongforge.core.kernels.reference.linear_cross_entropy``. Tokens are processed in
chunks: a chunk's logits ``[C, V]`` come from one matmul, a Triton kernel reduces each row to its
log-sum-exp with an online (running max) softmax over vocab blocks and emits the loss. Only the
per-token fp32 log-sum-exp is saved. The backward recomputes each chunk's logits, a second
kernel turns them in place into ``dloss * (softmax - onehot)`` (zero at ``ignore_index``), and two
matmuls add the chunk's share of ``dhidden`` and ``dweight`` (accumulated in fp32). The chunk is
sized so its logits take about as much memory as ``hidden``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loongforge.kernels.launch import check_tensors

BLOCK_VOCAB = 4096  # vocab entries per step of the per-row loops


@triton.jit
def _ce_forward(
    LOGITS, LABELS, LOSS, LSE,
    n_vocab, stride_logits, ignore_index,
    BLOCK: tl.constexpr,
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
    target = tl.load(base + tl.where(ignored, 0, label)).to(tl.float32)
    tl.store(LOSS + row, tl.where(ignored, 0.0, lse - target))
    tl.store(LSE + row, lse)


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
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)
        grad = tl.where(cols == label, p - 1.0, p) * scale
        tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)


def token_chunk(n_tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: a power of two whose ``[chunk, vocab]`` logits are about ``[n_tokens, hidden]``."""
    return min(max(n_tokens, 1), triton.next_power_of_2(triton.cdiv(max(n_tokens, 1), triton.cdiv(vocab, hidden))))


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
    vocab = weight.shape[0]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        value = labels[bad][0].item()
        raise ValueError(
            f"linear_cross_entropy: label {value} is outside [0, {vocab}) and is not ignore_index={ignore_index}"
        )


@functools.cache
def _fp32_accumulating_mm(device_type: str) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32)`` (half-precision inputs, fp32 result added in
    place) runs here: CUDA builds of torch >= 2.8; elsewhere the product is added separately."""
    if device_type != "cuda":
        return False
    try:
        acc = torch.zeros(2, 2, device=device_type)
        half = torch.ones(2, 2, device=device_type, dtype=torch.bfloat16)
        torch.addmm(acc, half, half, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return bool((acc == 2).all())


def _chunks(n_tokens: int, chunk: int):
    for start in range(0, n_tokens, chunk):
        yield start, min(start + chunk, n_tokens)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index):
        _check(hidden, weight, labels, ignore_index)
        hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
        n_tokens, n_hidden = hidden.shape
        vocab = weight.shape[0]
        loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        chunk = token_chunk(n_tokens, vocab, n_hidden)
        buf = torch.empty((chunk, vocab), dtype=hidden.dtype, device=hidden.device)
        for start, end in _chunks(n_tokens, chunk):
            logits = buf[: end - start]
            torch.mm(hidden[start:end], weight.t(), out=logits)
            _ce_forward[(end - start,)](
                logits, labels[start:end], loss[start:end], lse[start:end],
                vocab, logits.stride(0), ignore_index, BLOCK=BLOCK_VOCAB, num_warps=8,
            )
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        n_tokens, n_hidden = hidden.shape
        vocab = weight.shape[0]
        dhidden = torch.empty_like(hidden) if need_hidden else None
        dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        chunk = token_chunk(n_tokens, vocab, n_hidden)
        buf = torch.empty((chunk, vocab), dtype=hidden.dtype, device=hidden.device)
        for start, end in _chunks(n_tokens, chunk):
            dlogits = buf[: end - start]
            torch.mm(hidden[start:end], weight.t(), out=dlogits)
            _ce_backward_in_place[(end - start,)](
                dlogits, labels[start:end], lse[start:end], dloss[start:end],
                vocab, dlogits.stride(0), dloss.stride(0), ctx.ignore_index, BLOCK=BLOCK_VOCAB, num_warps=8,
            )
            if need_hidden:
                torch.mm(dlogits, weight, out=dhidden[start:end])
            if need_weight:
                if dweight.dtype == dlogits.dtype:
                    dweight.addmm_(dlogits.t(), hidden[start:end])
                elif _fp32_accumulating_mm(dweight.device.type):  # the GEMM adds into the fp32 sum
                    torch.addmm(dweight, dlogits.t(), hidden[start:end], out_dtype=torch.float32, out=dweight)
                else:  # half-precision matmul per chunk, fp32 sum over chunks
                    dweight.add_(dlogits.t() @ hidden[start:end])
        return dhidden, dweight.to(weight.dtype) if need_weight else None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Fused ``loongforge.core.kernels.reference.linear_cross_entropy``: per-token fp32 losses."""
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index)
