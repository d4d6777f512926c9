"""Counting host reads in tests: ``counted_reads(tensor, reads)`` is ``tensor`` as a subclass that
appends the name of every host read (``tolist``, ``item``, ``int``) of it, or of a tensor computed
from it, to the list ``reads``."""

from __future__ import annotations

import torch

READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__)


def counted_reads(tensor: torch.Tensor, reads: list[str]) -> torch.Tensor:
    class CountedReads(torch.Tensor):
        """Records every host read of this tensor or of a tensor computed from it in ``reads``."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in READS:
                reads.append(func.__name__)
            return super().__torch_function__(func, types, args, kwargs or {})

    return tensor.as_subclass(CountedReads)
