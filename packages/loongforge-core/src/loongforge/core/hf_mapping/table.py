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

Besides rules, a table lists HF tensors that are not converted one to one: ``Ignore`` (tolerated
on import, never written), ``Tied`` (a copy of another HF tensor: read only when the original is
absent, written as a copy) and ``Unused`` (a tensor the LoongForge model has no use for: dropped
on import, written as zeros on export).
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
    value = size(cfg) if callable(size) else config_value(cfg, size)
    if value is None:
        raise MappingError(f"the model config ({type(cfg).__name__}) gives no value for {size!r}")
    return int(value)


def _regex(pattern: str) -> re.Pattern:
    """``pattern`` as a regex matching whole names, each placeholder capturing its index (a
    placeholder repeated in one pattern must repeat the same index)."""
    out, seen = [], set()
    for i, part in enumerate(PLACEHOLDER.split(pattern)):  # literal text and placeholder names alternate
        if i % 2 == 0:
            out.append(re.escape(part))
        else:
            out.append(f"(?P={part})" if part in seen else rf"(?P<{part}>\d+)")
            seen.add(part)
    return re.compile("".join(out) + r"\Z")


def _expand(patterns: tuple[str, ...], sizes: Mapping[str, int], what: str) -> Iterator[tuple[str, ...]]:
    """``patterns`` filled in for every value of their placeholders (together)."""
    names = list(dict.fromkeys(p for pat in patterns for p in placeholders(pat)))
    unranged = set(names) - set(sizes)
    if unranged:
        raise MappingError(f"{what}: placeholder(s) {sorted(unranged)} have no range")
    for combo in itertools.product(*(range(sizes[p]) for p in names)):
        values = dict(zip(names, combo))
        yield tuple(fill(pat, values) for pat in patterns)


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
        return _regex(self.hf)


@dataclass(frozen=True)
class Tied:
    """An HF tensor ``hf`` holding a copy of the HF tensor ``of`` (an ``lm_head`` tied to the
    token embedding). Import reads it in place of ``of`` only when the checkpoint lacks ``of``
    (otherwise it is dropped); export writes it as a copy of ``of``. ``hf`` and ``of`` hold the
    same placeholders."""

    hf: str
    of: str
    when: Condition = None

    def __post_init__(self):
        if set(placeholders(self.hf)) != set(placeholders(self.of)):
            raise MappingError(f"tied tensor {self.hf!r} and its original {self.of!r} must hold the same placeholders")


@dataclass(frozen=True)
class Unused:
    """An HF tensor ``hf`` the LoongForge model has no use for (a head its architecture never
    runs): dropped on import when present, written on export as zeros of ``shape`` (each size
    an int, a config attribute name or a callable on the config, as in ``ranges``) in the dtype
    and on the device of the LF tensor ``like``. ``like``'s placeholders are among ``hf``'s."""

    hf: str
    shape: tuple[Size, ...]
    like: str
    when: Condition = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        if not set(placeholders(self.like)) <= set(placeholders(self.hf)):
            raise MappingError(f"unused tensor {self.hf!r}: {self.like!r} holds a placeholder {self.hf!r} does not")


@dataclass(frozen=True)
class ZerosOnExport:
    """An ``Unused`` tensor bound to a config: its name, the LF tensor whose dtype it takes and
    its shape (resolved when written, so binding needs no sizes only export uses)."""

    hf: str
    like: str
    sizes: tuple[Size, ...]
    cfg: Any = field(repr=False)

    def shape(self) -> tuple[int, ...]:
        return tuple(_size(s, self.cfg) for s in self.sizes)


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
    leading axis. ``ignore`` lists tolerated extra HF tensors, ``tied`` HF tensors that copy
    another one, ``unused`` HF tensors the model does not use (written as zeros on export).
    """

    rules: tuple[Rule, ...]
    ranges: Mapping[str, Size] = field(default_factory=dict)
    stacked: tuple[tuple[str, str], ...] = ()
    ignore: tuple[Ignore, ...] = ()
    tied: tuple[Tied, ...] = ()
    unused: tuple[Unused, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "stacked", tuple(tuple(s) for s in self.stacked))
        for name in ("ignore", "tied", "unused"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
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
        tied = {alias: of for t in self.tied if _holds(t.when, cfg)
                for alias, of in _expand((t.hf, t.of), sizes, f"tied tensor {t.hf!r}")}
        zeros = [ZerosOnExport(name, like, u.shape, cfg) for u in self.unused if _holds(u.when, cfg)
                 for name, like in _expand((u.hf, u.like), sizes, f"unused tensor {u.hf!r}")]
        return BoundMapping(conversions, locations, ignore, tied=tied, zeros=zeros)

    def counts_in(self, names: Iterable[str], side: str = "hf") -> dict[str, int]:
        """Each placeholder's range as ``names`` show it: one more than the largest index it
        takes in a name matching one of the rules' patterns of ``side`` (``"hf"`` or ``"lf"``);
        0 where no name shows it. For binding to a state dict that comes without its config;
        a gap in the indices is then a missing tensor that ``check_hf``/``check_lf`` names."""
        if side not in ("hf", "lf"):
            raise ValueError(f"side must be 'hf' or 'lf', not {side!r}")
        regexes = [_regex(pat) for rule in self.rules for pat in getattr(rule, side) if placeholders(pat)]
        counts = {name: 0 for name in self.ranges}
        for name in names:
            for rx in regexes:
                m = rx.match(name)
                if m:
                    for key, index in m.groupdict().items():
                        counts[key] = max(counts.get(key, 0), int(index) + 1)
        return counts


class BoundMapping:
    """A mapping table expanded for one model config.

    ``to_lf(get)`` / ``to_hf(get)`` stream ``(name, tensor)`` pairs, one conversion at a time,
    pulling the source tensors through ``get(name)`` (so only one conversion's tensors are in
    memory). Run ``check_hf``/``check_lf`` on the available names first for a complete error.
    Bound mappings of several components combine with ``prefixed`` and ``+`` (a VLM: vision
    tower + language model).

    ``hf_names`` are the HF tensors the conversions read; export also writes ``tied`` (alias ->
    original) copies and ``zeros`` (``export_names`` lists all). ``sources(names)`` says which
    tensor of a checkpoint to read for each HF name (a tied copy stands in for its original).
    """

    def __init__(self, conversions: list[Conversion], locations: dict[str, Location], ignore: tuple[re.Pattern, ...] = (),
                 *, tied: Mapping[str, str] | None = None, zeros: Iterable[ZerosOnExport] = ()):
        self.conversions = list(conversions)
        self.locations = dict(locations)
        self.ignore = tuple(ignore)
        self.tied = dict(tied or {})
        self.zeros = list(zeros)
        self.hf_names = [n for c in self.conversions for n in c.hf]
        self.lf_names = [n for c in self.conversions for n in c.lf]
        self.export_names = self.hf_names + list(self.tied) + [z.hf for z in self.zeros]
        for side, names in (("HF", self.export_names), ("LF", self.lf_names)):
            seen: set[str] = set()
            dup: set[str] = set()
            for n in names:
                (dup if n in seen else seen).add(n)
            if dup:
                raise MappingError(f"the mapping names these {side} tensors more than once: {summarize_names(dup)}")
        converted, lf = set(self.hf_names), set(self.lf_names)
        for alias, of in self.tied.items():
            if of not in converted:
                raise MappingError(f"tied tensor {alias!r} copies {of!r}, which no rule maps")
        for z in self.zeros:
            if z.like not in lf:
                raise MappingError(f"unused tensor {z.hf!r} takes the dtype of {z.like!r}, which no rule maps")
        self._aliases: dict[str, list[str]] = {}
        for alias, of in self.tied.items():
            self._aliases.setdefault(of, []).append(alias)
        self._zeros_like: dict[str, list[ZerosOnExport]] = {}
        for z in self.zeros:
            self._zeros_like.setdefault(z.like, []).append(z)

    def __len__(self) -> int:
        return len(self.conversions)

    def __add__(self, other: BoundMapping) -> BoundMapping:
        return BoundMapping(self.conversions + other.conversions, {**self.locations, **other.locations}, self.ignore + other.ignore,
                            tied={**self.tied, **other.tied}, zeros=self.zeros + other.zeros)

    def prefixed(self, hf: str = "", lf: str = "") -> BoundMapping:
        """The same mapping with every HF name prefixed by ``hf`` and every LF name (and
        sharded key) by ``lf``."""
        return self._renamed(lambda n: hf + n, lambda r: re.compile(re.escape(hf) + r.pattern), lf)

    def hf_prefix_replaced(self, old: str, new: str) -> BoundMapping:
        """The same mapping with the HF names that start with ``old`` starting with ``new``
        instead (a language model nested in a multimodal checkpoint: ``model.`` ->
        ``model.language_model.``); other names are kept."""
        escaped_old, escaped_new = re.escape(old), re.escape(new)

        def name(n: str) -> str:
            return new + n[len(old):] if n.startswith(old) else n

        def regex(r: re.Pattern) -> re.Pattern:
            p = r.pattern
            return re.compile(escaped_new + p[len(escaped_old):]) if p.startswith(escaped_old) else r

        return self._renamed(name, regex, "")

    def _renamed(self, hf: Callable[[str], str], hf_regex: Callable[[re.Pattern], re.Pattern], lf: str) -> BoundMapping:
        convs = [Conversion(tuple(hf(n) for n in c.hf), tuple(lf + n for n in c.lf), c.transform, c.bindings, c.cfg)
                 for c in self.conversions]
        locs = {lf + n: Location(lf + loc.key, loc.offsets, loc.sizes) for n, loc in self.locations.items()}
        ignore = tuple(hf_regex(r) for r in self.ignore)
        tied = {hf(alias): hf(of) for alias, of in self.tied.items()}
        zeros = [ZerosOnExport(hf(z.hf), lf + z.like, z.sizes, z.cfg) for z in self.zeros]
        return BoundMapping(convs, locs, ignore, tied=tied, zeros=zeros)

    def is_ignored(self, hf_name: str) -> bool:
        return any(r.match(hf_name) for r in self.ignore)

    def sources(self, names: Iterable[str]) -> dict[str, str]:
        """For each HF tensor the conversions read, the tensor of ``names`` (a checkpoint's) to
        read it from: itself, else a tied copy of it. Tensors with neither are left out."""
        names = set(names)
        out = {}
        for n in self.hf_names:
            if n in names:
                out[n] = n
            else:
                copy = next((a for a in self._aliases.get(n, ()) if a in names), None)
                if copy is not None:
                    out[n] = copy
        return out

    def _check(self, side: str, missing: list[str], unexpected: list[str], source: str) -> None:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s) the mapping needs: {summarize_names(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} tensor(s) the mapping does not know: {summarize_names(unexpected)}")
        if problems:
            raise MappingError(f"{source}: {side} state dict does not match the mapping: " + "; ".join(problems))

    def check_hf(self, names: Iterable[str], source: str = "HF checkpoint", *, partial: bool = False) -> None:
        """Raise naming every missing HF tensor (with no tied copy either; not with ``partial``)
        and every unexpected one (not converted, tied, unused or ignored)."""
        names = set(names)
        found = self.sources(names)
        known = set(self.export_names)
        self._check("HF", [] if partial else [n for n in self.hf_names if n not in found],
                    [n for n in names if n not in known and not self.is_ignored(n)], source)

    def check_lf(self, names: Iterable[str], source: str = "LoongForge checkpoint") -> None:
        """Raise naming every missing and every unexpected LF tensor."""
        names, expected = set(names), set(self.lf_names)
        self._check("LF", [n for n in self.lf_names if n not in names], [n for n in names if n not in expected], source)

    def to_lf(self, get: Callable[[str], torch.Tensor], names: Iterable[str] | None = None, *,
              partial: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The LF tensors, pulling HF tensors through ``get``. With ``names`` (the HF tensors
        present) a tied copy stands in for a missing original; ``partial`` then skips the
        conversions whose tensors are not all present (e.g. the gradients of a subset)."""
        found = self.sources(names) if names is not None else {n: n for n in self.hf_names}
        for conv in self.conversions:
            absent = [n for n in conv.hf if n not in found]
            if absent and partial:
                continue
            if absent:
                raise MappingError(f"HF tensor(s) {summarize_names(absent)} missing (no tied copy either)")
            yield from zip(conv.lf, conv.to_lf([get(found[n]) for n in conv.hf]))

    def hf_outputs(self, conv: Conversion, lf_tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """What exporting one conversion writes: its HF tensors, a copy for each tied alias of
        them and the zeros of each unused tensor that takes its dtype from one of its LF tensors."""
        out = list(zip(conv.hf, conv.to_hf(lf_tensors)))
        for name, tensor in list(out):
            out += [(alias, tensor.clone()) for alias in self._aliases.get(name, ())]
        for name, tensor in zip(conv.lf, lf_tensors):
            out += [(z.hf, torch.zeros(z.shape(), dtype=tensor.dtype, device=tensor.device)) for z in self._zeros_like.get(name, ())]
        return out

    def to_hf(self, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF tensors (tied copies and unused zeros included), pulling LF tensors through ``get``."""
        for conv in self.conversions:
            yield from self.hf_outputs(conv, [get(n) for n in conv.lf])

    def location(self, lf_name: str) -> Location:
        return self.locations[lf_name]
