"""A cheap function's output freed after the forward and recomputed for the backward.

``y = f(x)`` feeds a layer that saves ``y`` for its own backward (a linear layer saves its input).
Keeping ``y`` costs ``y``'s memory per layer; ``DiscardedOutput`` runs ``f`` without recording a
graph, lets the consumer save ``y``, then frees ``y``'s storage. When the backward reaches the
consumer's output (a gradient hook on it), ``f(x)`` is recomputed, with a graph, into ``y``'s own
storage, so the consumer's saved tensor is whole again before its backward reads it; ``f``'s own
backward then runs through the recomputed graph.

This is what megatron-core's ``CheckpointWithoutOutput`` does, without its C++ extension (built
with a compiler at run time, on the first backward, behind a file lock that a killed run leaves
behind): the recomputed values are copied into the refilled storage, one elementwise pass over ``y``.
``f`` must be deterministic (norms, activations): no RNG state is replayed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Run(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, holder, *inputs):
        with torch.no_grad():
            out = fn(*inputs)
        ctx.save_for_backward(*inputs)
        holder.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.recomputed
        ctx.recomputed = None
        torch.autograd.backward(out, grad)
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


class DiscardedOutput:
    """One use: ``y = d.run(f, x)``, then ``z = consumer(y)``, then ``d.discard(z)``."""

    def __init__(self):
        self.fn: Callable | None = None
        self.ctx = None
        self.output: torch.Tensor | None = None
        self.nbytes = 0

    def run(self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        self.fn = fn
        self.output = _Run.apply(fn, self, *inputs)
        return self.output

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage; it is recomputed when ``hook_tensor``'s gradient arrives
        (``hook_tensor``: the consumer's output, whose backward needs the freed tensor). Without a
        backward to come (no grad recorded, e.g. under ``torch.no_grad()``) the output is kept."""
        if not hook_tensor.requires_grad:
            return
        self.nbytes = self.output.untyped_storage().nbytes()
        self.output.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, grad):
        if self.ctx is None:  # already done (the hook tensor was used twice)
            return grad
        inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in self.ctx.saved_tensors)
        with torch.enable_grad():
            out = self.fn(*inputs)
        # refill the freed storage through an alias of its own (the consumer's saved tensor keeps
        # its version counter, so autograd sees no in-place change)
        y = self.output
        storage = y.untyped_storage()
        storage.resize_(self.nbytes)
        alias = torch.empty(0, dtype=y.dtype, device=y.device).set_(storage, y.storage_offset(), y.shape, y.stride())
        with torch.no_grad():
            alias.copy_(out)
        self.ctx.recomputed = (inputs, out)
        self.fn = self.ctx = self.output = None
        return grad
