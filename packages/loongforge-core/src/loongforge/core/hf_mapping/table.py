"""Declarative mapping tables: HF state-dict names <-> LoongForge (megatron-core) names.

A ``Rule`` pairs HF name patterns with LF name patterns and names a transform. Placeholders
(``{layer}``, ``{expert}``) stand for integer indices whose ranges the table declares from the
model config. ``HFMapping.bind(cfg)`` expands the table for one config into concrete
``Conversion``s, so both directions know exactly which tensors to expect: a missing tensor or
a leftover one is an error naming it.

A placeholder present on both sides of a rule makes one conversion per value; one present on
a single side is *gathered*: all its values go into the same conversion, index-major then
pattern order (e.g. ``{expert}`` on the HF side only: the per-expert tensors of a layer fuse
into one LF tensor).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from loongforge.core.hf_mapping.transforms import MappingError, Transform, TransformContext, config_value, get_transform

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")

# A condition on the model config: an attribute name ("add_qkv_bias"), its negation
# ("not tie_embeddings"), or a callable cfg -> bool.
Condition = str | Callable[[Any], bool] | None
# A placeholder's range: a fixed count, a config attribute name, or a callable cfg -> int.
Size = int | str | Callable[[Any], int]


def placeholders(pattern: str) -> list[str]:
    """The placeholder names of ``pattern`` in order of first appearance."""
    return list(dict.fromkeys(PLACEHOLDER.findall(pattern)))


def fill(pattern: str, values: Mapping[str, int]) -> str:
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), pattern)


def _holds(when: Condition, cfg) -> bool:
    if when is None:
        return True
    if callable(when):
        return bool(when(cfg))
    negate = when.startswith("not ")
    value = bool(config_value(cfg, when[4:].strip() if negate else when))
    return not value if negate else value


def _size(size: Size, cfg) -> int:
    if isinstance(size, int):
        return size
    return int(size(cfg) if callable(size) else config_value(cfg, size))


def _as_tuple(names: str | Iterable[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


@dataclass(frozen=True)
class Rule:
    """HF names ``hf`` <-> LF names ``lf`` through the registered transform ``transform``,
    applied only when ``when`` holds for the model config."""

    hf: str | tuple[str, ...]
    lf: str | tuple[str, ...]
    transform: str = "identity"
    when: Condition = None

    def __post_init__(self):
        object.__setattr__(self, "hf", _as_tuple(self.hf))
        object.__setattr__(self, "lf", _as_tuple(self.lf))
        if not self.hf or not self.lf:
            raise MappingError(f"rule {self.hf} -> {self.lf}: both sides need at least one name")


@dataclass(frozen=True)
class Ignore:
    """HF tensors that may be present and are dropped on import (old ``rotary_emb.inv_freq``
    buffers, an ``lm_head`` duplicating tied embeddings); never written on export."""

    hf: str
    when: Condition = None

    def regex(self) -> re.Pattern:
        parts = PLACEHOLDER.split(self.hf)
        # split() alternates literal text and placeholder names
        return re.compile("".join(re.escape(p) if i % 2 == 0 else r"\d+" for i, p in enumerate(parts)) + r"\Z")


@dataclass(frozen=True)
class Location:
    """Where an LF tensor lives in megatron's sharded state dict (and so in a LoongForge
    checkpoint): tensor ``key``, at index ``offsets`` of its leading stacked axes of ``sizes``."""

    key: str
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Conversion:
    """One application of a rule: concrete names on both sides."""

    hf: tuple[str, ...]
    lf: tuple[str, ...]
    transform: Transform
    bindings: Mapping[str, int]
    cfg: Any = field(repr=False)

    def _ctx(self) -> TransformContext:
        return TransformContext(self.cfg, self.bindings, self.hf, self.lf)

    def _checked(self, out, expected: tuple[str, ...], direction: str) -> list[torch.Tensor]:
        out = list(out)
        if len(out) != len(expected):
            raise MappingError(f"transform {type(self.transform).__name__} ({direction}) returned {len(out)} tensors for {list(expected)}")
        return out

    def to_lf(self, hf_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._checked(self.transform.to_lf(list(hf_tensors), self._ctx()), self.lf, "to LF")

    def to_hf(self, lf_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._checked(self.transform.to_hf(list(lf_tensors), self._ctx()), self.hf, "to HF")


def summarize_names(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


@dataclass(frozen=True)
class HFMapping:
    """A family's mapping table.

    ``ranges`` gives each placeholder's count. ``stacked`` lists ``(fragment, replacement)``
    pairs describing how megatron's sharded state dict folds per-index names into stacked
    tensors: the LF name ``decoder.layers.3.mlp.linear_fc2.weight`` with
    ``("decoder.layers.{layer}.", "decoder.layers.")`` is index 3 of the leading axis of
    ``decoder.layers.mlp.linear_fc2.weight``. Fragments are applied in order, each adding one
    leading axis. ``ignore`` lists tolerated extra HF tensors.
    """

    rules: tuple[Rule, ...]
    ranges: Mapping[str, Size] = field(default_factory=dict)
    stacked: tuple[tuple[str, str], ...] = ()
    ignore: tuple[Ignore, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "stacked", tuple(tuple(s) for s in self.stacked))
        object.__setattr__(self, "ignore", tuple(self.ignore))
        for fragment, _ in self.stacked:
            if len(placeholders(fragment)) != 1:
                raise MappingError(f"stacked fragment {fragment!r} must hold exactly one placeholder")

    def _location(self, pattern: str, values: Mapping[str, int], sizes: Mapping[str, int]) -> Location:
        axes = []
        for fragment, replacement in self.stacked:
            if fragment in pattern:
                pattern = pattern.replace(fragment, replacement, 1)
                axes.append(placeholders(fragment)[0])
        return Location(fill(pattern, values), tuple(values[a] for a in axes), tuple(sizes[a] for a in axes))

    def bind(self, cfg: Any) -> BoundMapping:
        """The concrete conversions for one model config."""
        sizes = {name: _size(size, cfg) for name, size in self.ranges.items()}
        conversions, locations = [], {}
        for rule in self.rules:
            if not _holds(rule.when, cfg):
                continue
            hf_ph = list(dict.fromkeys(p for pat in rule.hf for p in placeholders(pat)))
            lf_ph = list(dict.fromkeys(p for pat in rule.lf for p in placeholders(pat)))
            unranged = set(hf_ph + lf_ph) - set(sizes)
            if unranged:
                raise MappingError(f"rule {list(rule.hf)} -> {list(rule.lf)}: placeholder(s) {sorted(unranged)} have no range")
            outer = [p for p in lf_ph if p in hf_ph]
            transform = get_transform(rule.transform)

            def expand(patterns, gathered, base):
                names, values = [], []
                for combo in itertools.product(*(range(sizes[p]) for p in gathered)):
                    v = {**base, **dict(zip(gathered, combo))}
                    for pat in patterns:
                        names.append(fill(pat, v))
                        values.append((pat, v))
                return tuple(names), values

            for combo in itertools.product(*(range(sizes[p]) for p in outer)):
                base = dict(zip(outer, combo))
                hf_names, _ = expand(rule.hf, [p for p in hf_ph if p not in lf_ph], base)
                lf_names, lf_values = expand(rule.lf, [p for p in lf_ph if p not in hf_ph], base)
                for n, k in ((transform.n_hf, len(hf_names)), (transform.n_lf, len(lf_names))):
                    if n is not None and n != k:
                        raise MappingError(f"rule {list(rule.hf)} -> {list(rule.lf)}: transform {rule.transform!r} "
                                           f"takes {transform.n_hf} HF and {transform.n_lf} LF tensors")
                conversions.append(Conversion(hf_names, lf_names, transform, base, cfg))
                for name, (pat, v) in zip(lf_names, lf_values):
                    locations[name] = self._location(pat, v, sizes)
        ignore = tuple(i.regex() for i in self.ignore if _holds(i.when, cfg))
        return BoundMapping(conversions, locations, ignore)


class BoundMapping:
    """A mapping table expanded for one model config.

    ``to_lf(get)`` / ``to_hf(get)`` stream ``(name, tensor)`` pairs, one conversion at a time,
    pulling the source tensors through ``get(name)`` (so only one conversion's tensors are in
    memory). Run ``check_hf``/``check_lf`` on the available names first for a complete error.
    Bound mappings of several components combine with ``prefixed`` and ``+`` (a VLM: vision
    tower + language model).
    """

    def __init__(self, conversions: list[Conversion], locations: dict[str, Location], ignore: tuple[re.Pattern, ...] = ()):
        self.conversions = list(conversions)
        self.locations = dict(locations)
        self.ignore = tuple(ignore)
        self.hf_names = [n for c in self.conversions for n in c.hf]
        self.lf_names = [n for c in self.conversions for n in c.lf]
        for side, names in (("HF", self.hf_names), ("LF", self.lf_names)):
            seen, dup = set(), set()
            for n in names:
                (dup if n in seen else seen).add(n)
            if dup:
                raise MappingError(f"the mapping names these {side} tensors more than once: {summarize_names(dup)}")

    def __len__(self) -> int:
        return len(self.conversions)

    def __add__(self, other: BoundMapping) -> BoundMapping:
        return BoundMapping(self.conversions + other.conversions, {**self.locations, **other.locations}, self.ignore + other.ignore)

    def prefixed(self, hf: str = "", lf: str = "") -> BoundMapping:
        """The same mapping with every HF name prefixed by ``hf`` and every LF name (and
        sharded key) by ``lf``."""
        convs = [Conversion(tuple(hf + n for n in c.hf), tuple(lf + n for n in c.lf), c.transform, c.bindings, c.cfg)
                 for c in self.conversions]
        locs = {lf + n: Location(lf + loc.key, loc.offsets, loc.sizes) for n, loc in self.locations.items()}
        ignore = tuple(re.compile(re.escape(hf) + r.pattern) for r in self.ignore)
        return BoundMapping(convs, locs, ignore)

    def is_ignored(self, hf_name: str) -> bool:
        return any(r.match(hf_name) for r in self.ignore)

    def _check(self, side: str, expected: list[str], names: Iterable[str], source: str, ignore) -> None:
        names = set(names)
        missing = [n for n in expected if n not in names]
        expected_set = set(expected)
        unexpected = [n for n in names if n not in expected_set and not ignore(n)]
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s) the mapping needs: {summarize_names(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} tensor(s) the mapping does not know: {summarize_names(unexpected)}")
        if problems:
            raise MappingError(f"{source}: {side} state dict does not match the mapping: " + "; ".join(problems))

    def check_hf(self, names: Iterable[str], source: str = "HF checkpoint") -> None:
        """Raise naming every missing and every unexpected (not ignored) HF tensor."""
        self._check("HF", self.hf_names, names, source, self.is_ignored)

    def check_lf(self, names: Iterable[str], source: str = "LoongForge checkpoint") -> None:
        """Raise naming every missing and every unexpected LF tensor."""
        self._check("LF", self.lf_names, names, source, lambda n: False)

    def to_lf(self, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for conv in self.conversions:
            yield from zip(conv.lf, conv.to_lf([get(n) for n in conv.hf]))

    def to_hf(self, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for conv in self.conversions:
            yield from zip(conv.hf, conv.to_hf([get(n) for n in conv.lf]))

    def location(self, lf_name: str) -> Location:
        return self.locations[lf_name]
