"""cuDNN attention over the segments of a pack, as one custom op (``loongforge_diffusion::segment_attention``).

A pack of several videos needs attention restricted to each video. One SDPA call per video runs
cuDNN's flash kernel (the fastest on Hopper: on an H200 ~570 TFLOP/s forward + backward at 14k
tokens, against ~330 for flash varlen), but a Python loop over the videos inside compiled code
specialises the graph on every pack's layout. This op takes the segment bounds as host tensors,
so compiled code calls it once whatever the layout, and the loop runs inside the op:

- forward: per segment ``aten::_scaled_dot_product_cudnn_attention`` with its log-sum-exp, written
  into one packed output ``[Tq, H, D]`` and one packed log-sum-exp ``[Tq, H]`` (fp32);
- backward (a second op): per segment ``aten::_scaled_dot_product_cudnn_attention_backward`` from
  the saved output and log-sum-exp, so nothing is recomputed;
- a segment with many more queries than keys (video tokens against a prompt) runs as a batch of
  query chunks against copies of its keys, as ``query_chunks.query_chunks`` decides, and its key and
  value gradients are summed over the chunks. Padded query rows get a zero output gradient, so
  they contribute nothing to any gradient.

CUDA only, fp16/bf16, no mask, scale ``1/sqrt(D)``.
"""

from __future__ import annotations

import torch

from loongforge.diffusion.model.query_chunks import as_query_chunks, from_query_chunks, key_copies, query_chunks


def _segments(q_bounds: torch.Tensor, k_bounds: torch.Tensor, tq: int, tk: int):
    """(query start, end, key start, end) of every segment with queries; the bounds must span all
    ``tq`` query rows and ``tk`` key rows, so every output row is written."""
    qb, kb = q_bounds.tolist(), k_bounds.tolist()
    if len(qb) != len(kb) or len(qb) < 2:
        raise ValueError(f"segment_attention: query bounds {qb} and key bounds {kb} must have the same count >= 2")
    if (qb[0], qb[-1], kb[0], kb[-1]) != (0, tq, 0, tk):
        raise ValueError(f"segment_attention: bounds {qb} and {kb} must span [0, {tq}] and [0, {tk}]")
    for s in range(len(qb) - 1):
        if qb[s + 1] > qb[s]:
            if kb[s + 1] == kb[s]:
                raise ValueError(f"segment_attention: segment {s} has queries {qb[s]}:{qb[s + 1]} but no keys")
            yield qb[s], qb[s + 1], kb[s], kb[s + 1]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"segment_attention runs cuDNN attention on CUDA fp16/bf16 tensors, got {q.device} {q.dtype}")
    if q.dim() != 3 or k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"segment_attention: expected q [Tq, H, D], k and v [Tk, H, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


@torch.library.custom_op("loongforge_diffusion::segment_attention", mutates_args=())
def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_bounds: torch.Tensor,
                      k_bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Tq, H, D]``, ``k``/``v`` ``[Tk, H, D]``; ``q_bounds``/``k_bounds``: host int64 ``[S + 1]``
    (segment ``s`` of the queries attends to segment ``s`` of the keys). Returns the output
    ``[Tq, H, D]`` and the log-sum-exp of every query row and head ``[Tq, H]`` (fp32)."""
    _check(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    for qa, qb, ka, kb in _segments(q_bounds, k_bounds, q.shape[0], k.shape[0]):
        chunks = query_chunks(qb - qa, kb - ka)
        o, stats = torch.ops.aten._scaled_dot_product_cudnn_attention(
            as_query_chunks(q[qa:qb], chunks), key_copies(k[ka:kb], chunks), key_copies(v[ka:kb], chunks), None, True)[:2]
        out[qa:qb] = from_query_chunks(o, qb - qa)
        lse[qa:qb] = from_query_chunks(stats.reshape(o.shape[:3]), qb - qa)
    return out, lse


@segment_attention.register_fake
def _(q, k, v, q_bounds, k_bounds):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("loongforge_diffusion::segment_attention_backward", mutates_args=())
def segment_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                               lse: torch.Tensor, q_bounds: torch.Tensor,
                               k_bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`segment_attention` w.r.t. ``q``, ``k``, ``v`` from its saved output and log-sum-exp."""
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    # keys of a segment without queries get zero gradients; every query row is written
    dq, dk, dv = q.new_empty(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the RNG state is unused
    for qa, qb, ka, kb in _segments(q_bounds, k_bounds, q.shape[0], k.shape[0]):
        chunks = query_chunks(qb - qa, kb - ka)
        qc, oc, doc = (as_query_chunks(t[qa:qb], chunks) for t in (q, out, dout))
        stats = as_query_chunks(lse[qa:qb, :, None], chunks).contiguous()  # [chunks, H, L', 1]
        lk = kb - ka
        g = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            doc, qc, key_copies(k[ka:kb], chunks), key_copies(v[ka:kb], chunks), oc, stats, seed, seed, None, None, None,
            qc.shape[2], lk, 0.0, False)
        dq[qa:qb] = from_query_chunks(g[0], qb - qa)
        dk[ka:kb] = g[1].sum(0).transpose(0, 1)
        dv[ka:kb] = g[2].sum(0).transpose(0, 1)
    return dq, dk, dv


@segment_attention_backward.register_fake
def _(dout, q, k, v, out, lse, q_bounds, k_bounds):  # row-major whatever the inputs' strides, as the op's
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, q_bounds, k_bounds = inputs
    ctx.save_for_backward(q, k, v, *output, q_bounds, k_bounds)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, q_bounds, k_bounds = ctx.saved_tensors
    return (*segment_attention_backward(dout, q, k, v, out, lse, q_bounds, k_bounds), None, None)


segment_attention.register_autograd(_backward, setup_context=_setup_context)
