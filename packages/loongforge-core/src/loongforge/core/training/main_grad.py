"""Whether the running backward's weight gradients may go straight into megatron DDP's buffer.

megatron DDP keeps each parameter's gradient in ``param.main_grad`` and adds ``param.grad`` into it
from a hook. A layer whose weight-gradient GEMM adds into ``main_grad`` itself (as megatron's Apex
path does) hands autograd a placeholder instead of the gradient, so that the hook runs but adds
nothing: right where the engine's schedule reads ``main_grad``, wrong for anyone who asks autograd
for the gradient itself (``torch.autograd.grad``, a test, a probe). The megatron engine runs its
schedule inside ``main_grad_fusion()``; such a layer takes its fused path only where
``main_grad_fusion_active()`` says so when its forward runs, and computes a plain gradient
elsewhere. The flag is a context variable: it belongs to the running schedule, not to the process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_ACTIVE: ContextVar[bool] = ContextVar("loongforge_main_grad_fusion", default=False)


@contextmanager
def main_grad_fusion() -> Iterator[None]:
    """Inside this block, layers may add their weight gradients into ``main_grad`` themselves."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def main_grad_fusion_active() -> bool:
    return _ACTIVE.get()
