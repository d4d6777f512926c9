"""ChunkPipe: a long sequence goes through the model in chunks, so that one micro-batch's activation
memory grows with the chunk rather than with the sequence, with the gradients of the whole sequence.

A model that takes part (``ChunkedModel``: one pipeline stage of it, or the whole model) runs one
chunk at a time: chunk ``i`` reads what the chunks before it left behind (``carried``: per chunk a
list of tensors, e.g. every attention layer's keys and values after RoPE) and the chunk's input
from the stage before (``None`` on the first stage), and returns its output (the per-token losses
on the last stage, the hidden states for the next stage otherwise) and its own carried tensors.
``chunked_loss`` runs it as one autograd function over the model's trainable parameters:

- **forward**: chunks ``0 .. n-1`` in order under ``no_grad``; only the carried tensors stay (for an
  LLM: the keys and values of every layer, a small part of what a layer saves for its backward),
  and on a stage after the first each chunk's input. Each chunk's output goes to the next stage as
  soon as it is computed, so the chunks of one micro-batch fill the pipeline. The last stage
  returns the per-token losses of the whole sequence, so the loss function, its normalisation and
  the schedule that calls ``backward`` are the ones a run without chunks uses.
- **backward**: chunks ``n-1 .. 0`` in reverse, on every stage. Chunk ``i`` is run again with
  gradients from its saved input, with fresh leaves standing for the carried tensors of the chunks
  before it, and ``torch.autograd.grad`` takes the gradient of its output (weighted by the
  gradient of the losses on the last stage, by the gradient the next stage sent back otherwise)
  plus its own carried tensors (weighted by what the later chunks' backwards accumulated for them)
  with respect to the parameters, those leaves and the chunk's input, whose gradient goes back to
  the stage before. The leaves' gradients accumulate for the earlier chunks; the parameters' sum
  over chunks is returned once, so a data-parallel wrapper's gradient hooks fire once per
  micro-batch as without chunks.

Under pipeline parallelism (``Stage`` over the pipeline group) the pipelining happens inside one
micro-batch, between its chunks: the engine runs the micro-batches one after another on every
stage (megatron's schedule without pipelining), and a stage before the last returns zeros for the losses, which
only the last stage computes; the gradient that reaches it through them is not used.

Only one chunk's activations exist at a time (plus the carried tensors of all chunks and their
gradients, and a later stage's inputs of all chunks); the price is one more forward of every chunk,
as with full recomputation, which ChunkPipe replaces. The gradients are those of the unchunked
sequence up to floating-point reassociation. The forward of a chunk must be deterministic (no
dropout): it runs twice.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist


class ChunkedModel(Protocol):
    """What ``chunked_loss`` runs: ``chunks`` pieces of one micro-batch, in order."""

    chunks: int
    loss_shape: tuple[int, ...]  # the per-token losses of the whole micro-batch

    def run_chunk(self, index: int, carried: list[list[torch.Tensor]],
                  stage_input: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Chunk ``index``'s output (per-token losses ``[b, chunk]`` on the last stage, the next
        stage's input otherwise) and the tensors it carries to later chunks, given the carried
        tensors of chunks ``0 .. index-1`` and the chunk's input from the stage before."""
        ...

    def input_buffer(self, index: int) -> torch.Tensor:
        """An empty tensor of the shape and dtype of chunk ``index``'s input from the stage before."""
        ...


class Stage:
    """Where this rank's pipeline stage sits in ``group`` (``None``: the only stage), and its
    point-to-point exchanges with the stages before and after it: sends are asynchronous (kept
    until ``wait``), receives block."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < size - 1 else None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def send(self, tensor: torch.Tensor, to: int | None) -> None:
        assert to is not None, "no stage to send to"  # callers check ``last`` first
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, group=self.group, group_dst=to), tensor))

    def recv(self, buffer: torch.Tensor, src: int | None) -> torch.Tensor:
        assert src is not None, "no stage to receive from"  # callers check ``first`` first
        dist.recv(buffer, group=self.group, group_src=src)
        return buffer

    def wait(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, model: ChunkedModel, stage: Stage, dim: int, *params: torch.Tensor) -> torch.Tensor:
        carried: list[list[torch.Tensor]] = []
        inputs: list[torch.Tensor | None] = []  # each chunk's input from the stage before
        losses, shapes = [], []
        with torch.no_grad():
            for index in range(model.chunks):
                x = None if stage.first else stage.recv(model.input_buffer(index), stage.prev)
                out, own = model.run_chunk(index, carried, x)
                carried.append([t.detach() for t in own])
                inputs.append(x)
                shapes.append((out.shape, out.dtype))
                if stage.last:
                    losses.append(out)
                else:
                    stage.send(out, stage.next)
            stage.wait()
        ctx.model, ctx.stage, ctx.dim, ctx.carried, ctx.inputs, ctx.shapes = model, stage, dim, carried, inputs, shapes
        ctx.params = params  # leaves of the model: referenced, not saved activations
        if not stage.last:  # the losses are the last stage's (see the module docstring)
            return params[0].new_zeros(model.loss_shape, dtype=torch.float32)
        return torch.cat(losses, dim=dim)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        model, stage, carried, inputs, params = ctx.model, ctx.stage, ctx.carried, ctx.inputs, ctx.params
        if stage.last:
            grad_pieces = grad_loss.split([shape[ctx.dim] for shape, _ in ctx.shapes], dim=ctx.dim)
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        carried_grads: list[list[torch.Tensor | None] | None] = [None] * model.chunks
        for index in reversed(range(model.chunks)):
            if stage.last:
                grad_out = grad_pieces[index]
            else:
                shape, dtype = ctx.shapes[index]
                grad_out = stage.recv(grad_loss.new_empty(shape, dtype=dtype), stage.next)
            leaves = [[t.detach().requires_grad_(t.is_floating_point()) for t in carried[j]] for j in range(index)]
            x = inputs[index]
            x = None if x is None else x.detach().requires_grad_()
            with torch.enable_grad():
                out, own = model.run_chunk(index, leaves, x)
            outputs, weights = [out], [grad_out]
            for tensor, grad in zip(own, carried_grads[index] or ()):
                if grad is not None:
                    outputs.append(tensor)
                    weights.append(grad)
            flat_leaves = [t for chunk in leaves for t in chunk if t.requires_grad]
            wrt = [*params, *flat_leaves, *([x] if x is not None else [])]
            grads = torch.autograd.grad(outputs, wrt, weights, allow_unused=True)
            for k, g in enumerate(grads[: len(params)]):
                if g is None:
                    continue
                if param_grads[k] is None:
                    param_grads[k] = g
                elif not getattr(params[k], "grad_added_to_main_grad", False):
                    param_grads[k] = param_grads[k] + g
                # (a layer that added its gradient into main_grad itself hands a placeholder, which the
                # DDP hook discards: one is enough, not a dense sum of them per chunk)
            leaf_grads = iter(grads[len(params):])
            for j, chunk in enumerate(leaves):
                acc: list[Any] = carried_grads[j] or [None] * len(chunk)
                for k, leaf in enumerate(chunk):
                    if not leaf.requires_grad:
                        continue
                    g = next(leaf_grads)
                    if g is not None:
                        acc[k] = g if acc[k] is None else acc[k] + g
                carried_grads[j] = acc
            if x is not None:
                grad_x = next(leaf_grads)
                stage.send(grad_x if grad_x is not None else torch.zeros_like(x), stage.prev)
            carried[index], inputs[index] = [], None  # no later chunk is left to read them
            carried_grads[index] = None
            del out, own, leaves, grads
        stage.wait()
        return (None, None, None, *param_grads)


def chunked_loss(model: ChunkedModel, params: list[torch.Tensor], stage: Stage | None = None,
                 dim: int = 1) -> torch.Tensor:
    """The per-token losses of the whole sequence (the chunks' concatenated along ``dim``), with
    ChunkPipe's backward (see the module docstring); ``params``: the trainable parameters of this
    stage; ``stage``: this rank's place in the pipeline (default: the only stage)."""
    if model.chunks < 1:
        raise ValueError(f"ChunkPipe: {model.chunks} chunks")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("ChunkPipe: the model has no trainable parameter")
    return _ChunkedLoss.apply(model, stage or Stage(), dim, *params)
