"""Input checks by named dims, for op references and fused kernels alike:
``check_shapes("op", q=(q, "B S H D"), kv=(kv, "B T D"))``; ``check_matrices`` for elementwise
ops over matrices of one shape."""

from __future__ import annotations

import torch


def check_shapes(op: str, **inputs: tuple[torch.Tensor, str]) -> dict[str, int]:
    """The size of each dim name of ``inputs`` (``name=(tensor, "dim names")``): each tensor has
    one dim per name of its pattern, and a name has one size wherever it stands; otherwise a
    ``ValueError`` that names ``op`` and gives every pattern and shape."""
    sizes: dict[str, int] = {}
    for tensor, pattern in inputs.values():
        names = pattern.split()
        if tensor.dim() != len(names) or any(sizes.setdefault(d, n) != n for d, n in zip(names, tensor.shape)):
            expected = ", ".join(f"{name} [{', '.join(p.split())}]" for name, (_, p) in inputs.items())
            got = ", ".join(str(tuple(t.shape)) for t, _ in inputs.values())
            raise ValueError(f"{op}: expected {expected}; got {got}")
    return sizes


def check_matrices(op: str, *tensors: torch.Tensor) -> None:
    """Clear error unless ``tensors`` are non-empty matrices of one shape."""
    shape = tensors[0].shape
    for t in tensors:
        if t.dim() != 2 or t.shape != shape:
            raise ValueError(f"{op}: expected matrices of one shape, got {[tuple(x.shape) for x in tensors]}")
    if not tensors[0].numel():
        raise ValueError(f"{op}: expected non-empty matrices, got {tuple(shape)}")
