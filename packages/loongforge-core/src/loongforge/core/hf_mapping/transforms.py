"""Tensor transforms between Hugging Face and megatron-core layouts, and their registry.

A transform converts the tensors of one rule application (a ``Conversion``) in both
directions: ``to_lf`` takes the HF tensors in the rule's HF-name order and returns the LF
tensors in its LF-name order; ``to_hf`` is the exact inverse. Transforms only reshape, split
and concatenate, so a round trip is bitwise. Rules name transforms by string; a family with a
layout of its own registers a ``Transform`` under a new name with ``register_transform``.
"""

from __future__ import annotations

import abc

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loongforge.core.errors import UserError


class MappingError(UserError, ValueError):
    """A state dict does not fit a mapping table (missing/unexpected names, wrong shapes)."""


@dataclass(frozen=True)
class TransformContext:
    """What a transform may need besides the tensors: the model config the mapping was bound
    to, the placeholder values of this application and the names (for error messages)."""

    cfg: Any
    bindings: Mapping[str, int]
    hf: tuple[str, ...]
    lf: tuple[str, ...]


def config_value(cfg: Any, name: str) -> Any:
    """``cfg.name`` for a config object, ``cfg[name]`` for a mapping."""
    try:
        return cfg[name] if isinstance(cfg, Mapping) else getattr(cfg, name)
    except (KeyError, AttributeError) as exc:
        raise MappingError(f"the model config ({type(cfg).__name__}) has no value {name!r}") from exc


def _independent(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with its own storage (split outputs are views of one tensor;
    safetensors refuses to save tensors that share memory)."""
    return t.clone(memory_format=torch.contiguous_format)


class Transform(abc.ABC):
    """Base class of transforms. ``n_hf``/``n_lf`` (None: any) are checked before each call.

    ``splits_rows``: ``to_hf`` of one LF tensor only reorders and splits its rows (dim 0), so it
    applies to any tensor with the same rows, e.g. the LoRA ``B`` (``[out, rank]``) of a fused
    layer: a fused q/k/v or gate/up adapter becomes one adapter per HF layer (``A`` shared)."""

    n_hf: int | None = None
    n_lf: int | None = None
    splits_rows: bool = False

    @abc.abstractmethod
    def to_lf(self, tensors: list[torch.Tensor], ctx: TransformContext) -> list[torch.Tensor]:
        """HF tensors -> LoongForge tensors."""

    @abc.abstractmethod
    def to_hf(self, tensors: list[torch.Tensor], ctx: TransformContext) -> list[torch.Tensor]:
        """LoongForge tensors -> HF tensors."""


class Identity(Transform):
    """Tensor i on one side is tensor i on the other."""

    def to_lf(self, tensors, ctx):
        if len(tensors) != len(ctx.lf):
            raise MappingError(f"identity rule maps {list(ctx.hf)} to {list(ctx.lf)}: counts differ")
        return list(tensors)

    def to_hf(self, tensors, ctx):
        if len(tensors) != len(ctx.hf):
            raise MappingError(f"identity rule maps {list(ctx.lf)} to {list(ctx.hf)}: counts differ")
        return list(tensors)


class FuseQKV(Transform):
    """HF ``q, k, v`` projections (weights ``[n*d, h]`` or biases ``[n*d]``) <-> megatron's
    fused ``linear_qkv`` in its per-query-group interleaved layout: for each of the ``g`` KV
    groups, that group's ``heads/g`` query heads, then its key head, then its value head.

    Megatron splits the fused tensor along dim 0 by groups for TP, so this global layout is the
    same for every TP size. The config attribute names are parameters so that other configs
    (a ViT's) can register their own instance.
    """

    n_hf, n_lf = 3, 1
    splits_rows = True

    def __init__(self, heads: str = "num_attention_heads", groups: str = "num_query_groups", head_dim: str = "head_dim"):
        self.heads, self.groups, self.head_dim = heads, groups, head_dim

    def _dims(self, ctx) -> tuple[int, int, int]:
        heads, groups = int(config_value(ctx.cfg, self.heads)), int(config_value(ctx.cfg, self.groups))
        d = int(config_value(ctx.cfg, self.head_dim))
        if heads % groups:
            raise MappingError(f"{self.heads}={heads} is not a multiple of {self.groups}={groups}")
        return heads, groups, d

    def to_lf(self, tensors, ctx):
        heads, groups, d = self._dims(ctx)
        q, k, v = tensors
        for name, t, rows in zip(ctx.hf, tensors, (heads * d, groups * d, groups * d)):
            if t.dim() < 1 or t.shape[0] != rows:
                raise MappingError(f"{name}: shape {list(t.shape)}, expected {rows} rows ({heads} heads, {groups} KV groups, head dim {d})")
        rest = q.shape[1:]
        if k.shape[1:] != rest or v.shape[1:] != rest:
            raise MappingError(f"{list(ctx.hf)}: trailing shapes differ ({list(q.shape)}, {list(k.shape)}, {list(v.shape)})")
        per = heads // groups
        fused = torch.cat([q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1)
        return [fused.reshape(groups * (per + 2) * d, *rest)]

    def to_hf(self, tensors, ctx):
        heads, groups, d = self._dims(ctx)
        (qkv,) = tensors
        per = heads // groups
        rows = groups * (per + 2) * d
        if qkv.dim() < 1 or qkv.shape[0] != rows:
            raise MappingError(f"{ctx.lf[0]}: shape {list(qkv.shape)}, expected {rows} rows ({heads} heads, {groups} KV groups, head dim {d})")
        rest = qkv.shape[1:]
        q, k, v = qkv.reshape(groups, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
        return [_independent(q.reshape(heads * d, *rest)), _independent(k.reshape(groups * d, *rest)),
                _independent(v.reshape(groups * d, *rest))]


class Concat(Transform):
    """Several HF tensors <-> one LF tensor concatenated along ``dim`` in rule order, with equal
    sizes (megatron's SwiGLU ``linear_fc1`` is ``[gate; up]``, TP-independent globally)."""

    n_lf = 1

    def __init__(self, dim: int = 0):
        self.dim = dim
        self.splits_rows = dim == 0

    def to_lf(self, tensors, ctx):
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise MappingError(f"{list(ctx.hf)}: shapes differ ({[list(t.shape) for t in tensors]}), cannot fuse into {ctx.lf[0]}")
        return [torch.cat(list(tensors), dim=self.dim)]

    def to_hf(self, tensors, ctx):
        (fused,) = tensors
        n = len(ctx.hf)
        if fused.shape[self.dim] % n:
            raise MappingError(f"{ctx.lf[0]}: dim {self.dim} of shape {list(fused.shape)} does not split into {n} parts")
        return [_independent(t) for t in fused.chunk(n, dim=self.dim)]


_TRANSFORMS: dict[str, Transform] = {}


def register_transform(name: str, transform: Transform) -> None:
    """Make ``transform`` available to rules as ``name``; a name is registered once."""
    if not isinstance(transform, Transform):
        raise TypeError(f"transform {name!r} must be a Transform instance, got {type(transform).__name__}")
    if name in _TRANSFORMS and _TRANSFORMS[name] is not transform:
        raise MappingError(f"transform {name!r} is already registered ({type(_TRANSFORMS[name]).__name__})")
    _TRANSFORMS[name] = transform


def get_transform(name: str) -> Transform:
    if name not in _TRANSFORMS:
        raise MappingError(f"unknown transform {name!r}; registered: {', '.join(sorted(_TRANSFORMS))}")
    return _TRANSFORMS[name]


register_transform("identity", Identity())
register_transform("fuse_qkv", FuseQKV())
register_transform("fuse_gate_up", Concat(dim=0))
