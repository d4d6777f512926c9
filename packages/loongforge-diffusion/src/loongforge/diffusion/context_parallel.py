"""Ulysses context parallelism: the packed token sequence is split evenly over the ranks of the
CP group; around self-attention an all-to-all turns "my tokens, all heads" into "all tokens, my
heads" (and back), so attention sees whole sequences while everything else stays token-local.
Cross-attention needs no communication (every rank holds all prompts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextParallel:
    group: object  # torch.distributed.ProcessGroup
    rank: int
    size: int

    @classmethod
    def from_group(cls, group) -> "ContextParallel | None":
        """None for a group of one (no context parallelism)."""
        if group is None or dist.get_world_size(group) == 1:
            return None
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))

    def local_range(self, num_tokens: int) -> tuple[int, int]:
        if num_tokens % self.size:
            raise ValueError(f"packed length {num_tokens} is not divisible by the context-parallel size {self.size}")
        n = num_tokens // self.size
        return self.rank * n, (self.rank + 1) * n


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    n, h, d = x.shape
    if h % cp.size:
        raise ValueError(f"{h} attention heads are not divisible by the context-parallel size {cp.size}")
    chunks = x.reshape(n, cp.size, h // cp.size, d).transpose(0, 1)  # [cp, n, h/cp, d]: heads for rank j
    return _all_to_all(chunks, cp.group).reshape(cp.size * n, h // cp.size, d)


def _heads_to_seq(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    total, hl, d = x.shape
    n = total // cp.size
    back = _all_to_all(x.reshape(cp.size, n, hl, d), cp.group)  # [cp, n, h/cp, d]: my tokens, head group j
    return back.transpose(0, 1).reshape(n, cp.size * hl, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.cp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _heads_to_seq(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.cp), None


def seq_to_heads(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``[N/cp, H, D]`` (local tokens) -> ``[N, H/cp, D]`` (all tokens, local heads)."""
    return _SeqToHeads.apply(x, cp)


def heads_to_seq(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``[N, H/cp, D]`` -> ``[N/cp, H, D]``."""
    return _HeadsToSeq.apply(x, cp)
