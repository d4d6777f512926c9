"""One check shared by the tests of autograd functions over registry ops (core's and the
modality packages' own): the function, eager or compiled, against autograd of the ops it replaces."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_compiled_like_composed(loss: Callable, composed: Callable, fused: Callable, leaves: list[torch.Tensor],
                                  backend: str) -> None:
    """``loss(fused, *leaves)`` (eager for ``backend="eager"``, else compiled with ``backend``)
    gives the value and leaf gradients of ``loss(composed, *leaves)`` under eager autograd."""
    results = []
    for impl, compile_with in ((composed, "eager"), (fused, backend)):
        copies = [t.clone().requires_grad_() for t in leaves]
        fn = loss if compile_with == "eager" else torch.compile(loss, backend=compile_with, fullgraph=True)
        torch._dynamo.reset()
        value = fn(impl, *copies)
        value.backward()
        results.append((value.detach(), [t.grad for t in copies]))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-4, rtol=1e-5)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
