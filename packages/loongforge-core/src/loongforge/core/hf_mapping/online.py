"""An HF model directory seen as a LoongForge checkpoint, for loading HF weights straight into
a (TP/PP/EP-sharded) megatron model without an offline conversion.

``HFPieceReader`` has the ``PieceReader`` interface (``keys``, ``global_shape``, ``read`` of a
region) that ``checkpoint.sharded.load_into`` reads a megatron sharded state dict from, so each
rank reads exactly its shards::

    reader = HFPieceReader(hf_dir, adapter.bind(model_config))
    state = load_into(model.sharded_state_dict(), reader, objects={}, common={})
    model.load_state_dict(state, strict=True)

A region is cut from the LF tensors of the conversions it overlaps, computed on demand from the
HF tensors (the last few are cached: megatron asks for a fused tensor's parts one by one).
``load_hf_weights`` does the above for a model; ``hf_model_config`` reads the family and model
config a directory holds (``lf-llm train model.init_from_hf=DIR``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from loongforge.core.checkpoint import CheckpointReadError
from loongforge.core.hf_mapping.adapter import HFAdapter, family_for_architectures
from loongforge.core.hf_mapping.hf_dir import HFReader
from loongforge.core.hf_mapping.table import BoundMapping, Conversion


class HFPieceReader:
    def __init__(self, hf_dir: str | Path, bound: BoundMapping, cache_size: int = 4):
        self.hf = HFReader(hf_dir)
        self.directory = self.hf.directory
        bound.check_hf(self.hf.names(), source=str(self.directory))
        self.bound = bound
        self._source = bound.sources(self.hf.names())  # a tied copy stands in for a missing original
        # sharded key -> stacked index -> (conversion, output position)
        self._sources: dict[str, dict[tuple[int, ...], tuple[Conversion, int]]] = {}
        self._sizes: dict[str, tuple[int, ...]] = {}
        for conv in bound.conversions:
            for i, name in enumerate(conv.lf):
                loc = bound.location(name)
                self._sources.setdefault(loc.key, {})[loc.offsets] = (conv, i)
                self._sizes[loc.key] = loc.sizes
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._cache: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self._cache_size = cache_size

    def keys(self):
        return self._sources.keys()

    def _outputs(self, conv: Conversion) -> list[torch.Tensor]:
        key = id(conv)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        out = conv.to_lf([self.hf.get(self._source[n]) for n in conv.hf])
        self._cache[key] = out
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out

    def _tensor(self, key: str, index: tuple[int, ...]) -> torch.Tensor:
        conv, i = self._sources[key][index]
        return self._outputs(conv)[i]

    def _meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        if key not in self._shapes:
            if key not in self._sources:
                raise CheckpointReadError(f"{self.directory}: the HF model has no tensor for {key!r}")
            t = self._tensor(key, next(iter(self._sources[key])))
            self._shapes[key] = (self._sizes[key] + tuple(t.shape), t.dtype)
        return self._shapes[key]

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self._meta(key)[0]

    def read(self, key: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of the LF tensor ``key`` (default: all of it)."""
        gshape, dtype = self._meta(key)
        offset = tuple(offset) if offset is not None else (0,) * len(gshape)
        shape = tuple(shape) if shape is not None else gshape
        if len(offset) != len(gshape) or any(o < 0 or o + s > g for o, s, g in zip(offset, shape, gshape)):
            raise CheckpointReadError(f"{self.directory}: tensor {key!r} has shape {list(gshape)}; the model asks for "
                                      f"region offset={list(offset)} shape={list(shape)} (config mismatch?)")
        k = len(self._sizes[key])
        inner = tuple(slice(o, o + s) for o, s in zip(offset[k:], shape[k:]))
        out = torch.empty(shape, dtype=dtype)
        for index in itertools.product(*(range(o, o + s) for o, s in zip(offset[:k], shape[:k]))):
            out[tuple(i - o for i, o in zip(index, offset[:k]))] = self._tensor(key, index)[inner]
        return out


def hf_model_config(hf_dir: str | Path) -> tuple[str, Any]:
    """``(family, model config)`` of the HF model directory ``hf_dir``, from its ``config.json``
    (the installed family that reads its ``architectures``). ``MappingError`` names the file."""
    hf = HFReader(hf_dir)
    family, adapter = family_for_architectures(hf.config.get("architectures"), source=str(hf.directory / "config.json"))
    return family, adapter.config_from_hf(hf.config)


def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path, adapter: HFAdapter, model_config: Any) -> None:
    """Fill the megatron ``model`` (one pipeline stage, any TP/EP shard) with its part of the
    HF weights in ``hf_dir``; the directory must hold the model ``model_config`` describes."""
    from loongforge.core.checkpoint.sharded import load_into

    reader = HFPieceReader(hf_dir, adapter.bind(model_config))
    model.load_state_dict(load_into(model.sharded_state_dict(), reader, {}, {}), strict=True)
