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
A consumer that knows the hand-over (``TakesDiscardedInput``: the fast layer spec's linears) saves
no ``y`` at all: it takes ``y`` from the ``DiscardedOutput`` in its backward, the recomputed tensor
itself, so neither the storage games nor the copy are needed. Where ``f`` has a backward that can
recompute ``y`` in the same pass (``run(..., backward=...)``: SwiGLU's reads ``x`` once for its
gradient and for ``y``), the consumer hands ``y``'s gradient over with the request (it computes its
input gradient before its weight gradient): ``f``'s backward then runs there, once, and ``f``'s node
in the graph returns the gradients it made.
``f`` must be deterministic (norms, activations): no RNG state is replayed.

``hand_over(y, f, *inputs)`` is the same bargain for a ``y = f(*inputs)`` made with its own graph
by an op that does not save ``y`` for its backward (the fused norms save their input and one
statistic per row): the op's backward runs as it is (the residual add and norm of ``add_rms_norm``
stay one kernel each way, the grad of the sum added inside the norm's backward), and only the
consumer's copy of ``y`` is freed and made again by ``f(*inputs)`` (one pass, no graph) when the
backward reaches it. ``inputs`` are kept as an op keeps what it saves for its backward, so
saved-tensor hooks (activation offload) apply to them as to every other saved activation.
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
        ctx.recomputed = ctx.input_grads = None
        holder.ctx = ctx
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.input_grads is not None:  # made by the consumer's request (fused backward), with this grad
            grads, ctx.input_grads = ctx.input_grads, None
            return (None, None, *grads)
        inputs, out = ctx.recomputed
        ctx.recomputed = None
        torch.autograd.backward(out, grad)
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))


class _KeepForRecompute(torch.autograd.Function):
    """Saves its inputs as an op saves tensors for its backward (under the saved-tensor hooks in
    effect, e.g. activation offload's) for a recomputation outside the graph; its output is only
    held to keep the node (and what it saved) alive."""

    @staticmethod
    def forward(ctx, holder, anchor, *inputs):
        ctx.save_for_backward(*inputs)
        holder.kept_ctx = ctx
        return (anchor if anchor is not None else inputs[0]).new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # its output feeds nothing: never reached
        return (None, None, *(None for _ in ctx.saved_tensors))


class TakesDiscardedInput:
    """A module that can take its next input from a ``DiscardedOutput`` rather than save it:
    ``DiscardedOutput.run(..., consumer=module)`` offers it (``discarded_input``); the module's
    forward calls ``claim(input)`` on it (and clears the offer), and its backward reads the input
    from ``recomputed_input()``."""

    discarded_input: DiscardedOutput | None = None


class DiscardedOutput:
    """One use: ``y = d.run(f, x)``, then ``z = consumer(y)``, then ``d.discard(z)``."""

    def __init__(self) -> None:
        self.fn: Callable | None = None
        self.backward: Callable | None = None
        self.remake: Callable[..., torch.Tensor] | None = None  # hand_over's f
        self.kept: torch.Tensor | None = None  # hand_over's _KeepForRecompute output (holds its node)
        self.kept_ctx = None
        self.ctx = None
        self.output: torch.Tensor | None = None
        self.nbytes = 0
        self.consumer: TakesDiscardedInput | None = None
        self.claimed = False
        self.recomputed: torch.Tensor | None = None

    def run(self, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor,
            consumer: object | None = None, backward: Callable | None = None) -> torch.Tensor:
        """``fn(*inputs)``, recorded for recomputation; ``consumer``: the module ``y`` is handed to,
        offered the hand-over where it takes it (``TakesDiscardedInput``); ``backward``:
        ``(grad_y, *inputs) -> (grads of inputs, y)``, ``fn``'s backward recomputing ``y`` in the same
        pass, used where the consumer takes ``y`` over."""
        self.fn, self.backward = fn, backward
        self.output = _Run.apply(fn, self, *inputs)
        if isinstance(consumer, TakesDiscardedInput):
            self.consumer = consumer
            consumer.discarded_input = self
        return self.output

    def hand_over(self, y: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor,
                  consumer: object | None = None) -> torch.Tensor:
        """``y = fn(*inputs)``, made with its graph by an op that does not save it, offered to
        ``consumer`` (as ``run``'s); ``fn(*inputs)`` makes it again (run without a graph) for the
        consumer's backward, ``inputs`` kept as saved activations are."""
        self.output, self.remake = y, fn
        # an input that requires grad makes the node that saves them; where none does, an anchor
        # that does (allocated only then: this runs twice a layer in the training step)
        anchor = None if any(t.requires_grad for t in inputs) else torch.empty(
            0, device=y.device, requires_grad=torch.is_grad_enabled())
        self.kept = _KeepForRecompute.apply(self, anchor, *inputs)
        if isinstance(consumer, TakesDiscardedInput):
            self.consumer = consumer
            consumer.discarded_input = self
        return y

    def claim(self, x: torch.Tensor) -> bool:
        """The consumer's forward: whether ``x`` is this output (then the consumer saves nothing of it
        and reads ``recomputed_input()`` in its backward)."""
        y = self.output
        self.claimed = (y is not None and x.data_ptr() == y.data_ptr() and x.shape == y.shape
                        and x.stride() == y.stride() and x.requires_grad)
        return self.claimed

    def recomputed_input(self, grad: torch.Tensor | None = None) -> torch.Tensor:
        """The recomputed output, for the consumer's backward (after ``discard``'s hook has run); read
        once (this drops its reference). ``grad``: the output's gradient (the consumer's input
        gradient), which a fused ``backward`` needs: it runs here, and ``fn``'s node returns its result."""
        if self.backward is not None and self.ctx is not None:
            if grad is None:
                raise RuntimeError("DiscardedOutput: the consumer must hand over the output's gradient "
                                   "(a fused backward recomputes the output from it)")
            grads, out = self.backward(grad, *self.ctx.saved_tensors)
            self.ctx.input_grads = grads if isinstance(grads, tuple) else (grads,)
            self.fn = self.backward = self.ctx = None
            return out
        if self.recomputed is None:
            raise RuntimeError("DiscardedOutput: the consumer's backward ran before the output was recomputed "
                               "(its gradient hook did not fire)")
        x, self.recomputed = self.recomputed, None
        return x

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage; it is recomputed when ``hook_tensor``'s gradient arrives
        (``hook_tensor``: the consumer's output, whose backward needs the freed tensor). Without a
        backward to come (no grad recorded, e.g. under ``torch.no_grad()``) the output is kept.
        Where the consumer took the output over (``claim``), nothing saved it: the recomputation
        hands its result to the consumer, and the freed storage stays freed."""
        if self.consumer is not None:
            self.consumer.discarded_input = None  # (an offer the consumer did not take ends here too)
            self.consumer = None
        if not hook_tensor.requires_grad:
            return
        if self.output is None:
            raise RuntimeError("DiscardedOutput.discard: nothing was run or handed over")
        self.nbytes = self.output.untyped_storage().nbytes()
        self.output.untyped_storage().resize_(0)
        if self.claimed:
            self.output = None
            if self.backward is not None:  # recomputed at the consumer's request, by the fused backward
                return
        else:
            self.backward = None  # (a consumer that saved the output needs it back before its backward)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, grad):
        if self.remake is not None:  # hand_over: y again, without a graph (its op's node is whole)
            with torch.no_grad():
                out = self.remake(*self.kept_ctx.saved_tensors)
            self.remake = self.kept = self.kept_ctx = None
            if self.claimed:
                self.recomputed = out
                return grad
        else:
            if self.ctx is None:  # already done (the hook tensor was used twice)
                return grad
            inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in self.ctx.saved_tensors)
            with torch.enable_grad():
                out = self.fn(*inputs)
            self.ctx.recomputed = (inputs, out)
            if self.claimed:  # the consumer reads it from here
                self.recomputed = out.detach()
                self.fn = self.ctx = None
                return grad
        # refill the freed storage through an alias of its own (the consumer's saved tensor keeps
        # its version counter, so autograd sees no in-place change)
        y = self.output
        storage = y.untyped_storage()
        storage.resize_(self.nbytes)
        alias = torch.empty(0, dtype=y.dtype, device=y.device).set_(storage, y.storage_offset(), y.shape, y.stride())
        with torch.no_grad():
            alias.copy_(out)
        self.fn = self.ctx = self.output = None
        return grad
