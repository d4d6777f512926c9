"""ChunkPipe: a long sequence goes through the model in chunks, so that one micro-batch's activation
memory grows with the chunk rather than with the sequence, with the gradients of the whole sequence.

A model that takes part (``ChunkedModel``) runs one chunk at a time: chunk ``i`` reads what the
chunks before it left behind (``carried``: per chunk a list of tensors, e.g. every attention layer's
keys and values after RoPE) and returns its per-token losses and its own carried tensors.
``chunked_loss`` runs it as one autograd function over the model's trainable parameters:

- **forward**: chunks ``0 .. n-1`` in order under ``no_grad``; only the carried tensors stay (for an
  LLM: the keys and values of every layer, a small part of what a layer saves for its backward);
  the per-token losses of the whole sequence come out, so the loss function, its normalisation and
  the schedule that calls ``backward`` are the ones a run without chunks uses.
- **backward**: chunks ``n-1 .. 0`` in reverse. Chunk ``i`` is run again with gradients, with
  fresh leaves standing for the carried tensors of the chunks before it, and
  ``torch.autograd.grad`` takes the gradient of its losses (weighted by the incoming gradient) plus
  its own carried tensors (weighted by what the later chunks' backwards accumulated for them)
  with respect to the parameters and those leaves. The leaves' gradients accumulate for the
  earlier chunks; the parameters' sum over chunks is returned once, so a data-parallel wrapper's
  gradient hooks fire once per micro-batch as without chunks.

Only one chunk's activations exist at a time (plus the carried tensors of all chunks and their
gradients); the price is one more forward of every chunk, as with full recomputation, which
ChunkPipe replaces. The gradients are those of the unchunked sequence up to floating-point
reassociation. The forward of a chunk must be deterministic (no dropout): it runs twice.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ChunkedModel(Protocol):
    """What ``chunked_loss`` runs: ``chunks`` pieces of one micro-batch, in order."""

    chunks: int

    def run_chunk(self, index: int, carried: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Chunk ``index``'s per-token losses (``[b, chunk]``) and the tensors it carries to later
        chunks, given the carried tensors of chunks ``0 .. index-1``."""
        ...


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model: ChunkedModel, dim: int, *params: torch.Tensor) -> torch.Tensor:
        carried: list[list[torch.Tensor]] = []
        losses = []
        with torch.no_grad():
            for index in range(model.chunks):
                loss, own = model.run_chunk(index, carried)
                carried.append([t.detach() for t in own])
                losses.append(loss)
        ctx.model, ctx.dim, ctx.carried = model, dim, carried
        ctx.sizes = [loss.shape[dim] for loss in losses]
        ctx.params = params  # leaves of the model: referenced, not saved activations
        return torch.cat(losses, dim=dim)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        model, carried, params = ctx.model, ctx.carried, ctx.params
        grad_pieces = grad_loss.split(ctx.sizes, dim=ctx.dim)
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        carried_grads: list[list[torch.Tensor | None] | None] = [None] * model.chunks
        for index in reversed(range(model.chunks)):
            leaves = [[t.detach().requires_grad_(t.is_floating_point()) for t in carried[j]] for j in range(index)]
            with torch.enable_grad():
                loss, own = model.run_chunk(index, leaves)
            outputs, weights = [loss], [grad_pieces[index]]
            for tensor, grad in zip(own, carried_grads[index] or ()):
                if grad is not None:
                    outputs.append(tensor)
                    weights.append(grad)
            flat_leaves = [t for chunk in leaves for t in chunk if t.requires_grad]
            grads = torch.autograd.grad(outputs, [*params, *flat_leaves], weights, allow_unused=True)
            for k, g in enumerate(grads[: len(params)]):
                if g is not None:
                    param_grads[k] = g if param_grads[k] is None else param_grads[k] + g
            leaf_grads = iter(grads[len(params):])
            for j, chunk in enumerate(leaves):
                acc = carried_grads[j] if carried_grads[j] is not None else [None] * len(chunk)
                for k, leaf in enumerate(chunk):
                    if not leaf.requires_grad:
                        continue
                    g = next(leaf_grads)
                    if g is not None:
                        acc[k] = g if acc[k] is None else acc[k] + g
                carried_grads[j] = acc
            carried[index] = []  # no later chunk is left to read it
            carried_grads[index] = None
            del loss, own, leaves, grads
        return (None, None, *param_grads)


def chunked_loss(model: ChunkedModel, params: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The per-token losses of the whole sequence (the chunks' concatenated along ``dim``), with
    ChunkPipe's backward (see the module docstring); ``params``: the trainable parameters."""
    if model.chunks < 1:
        raise ValueError(f"ChunkPipe: {model.chunks} chunks")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("ChunkPipe: the model has no trainable parameter")
    return _ChunkedLoss.apply(model, dim, *params)
