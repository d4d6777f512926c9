"""Declarative state-dict name mapping.

A ``NameMap`` is a table of ``Rule``s. Each rule pairs a source-name pattern with a target-name
pattern; ``{i}`` matches a layer number and ``{rest}`` a dotted tail, and both carry over.
Kinds: ``rename`` (one tensor each way), ``tied`` (a source tensor that duplicates the target
tensor named by ``target``: used on import only when the checkpoint lacks the renamed original,
copied on export) and ``unused`` (a source tensor
the target model has no use for: dropped on import, written as zeros of ``shape(target_sd)`` on
export). Every source key must match exactly one rule and every target key must be produced,
so a layout change is an error naming the key, never a silent partial load.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

_PLACEHOLDERS = {"i": r"(?P<i>\d+)", "rest": r"(?P<rest>[A-Za-z0-9_.]+)"}


def _compile(pattern: str) -> re.Pattern:
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        if m.group(1) not in _PLACEHOLDERS:
            raise ValueError(f"name pattern {pattern!r}: unknown placeholder {{{m.group(1)}}}")
        out.append(_PLACEHOLDERS[m.group(1)])
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("^" + "".join(out) + "$")


@dataclass(frozen=True)
class Rule:
    source: str
    target: str
    kind: str = "rename"  # rename | tied | unused
    shape: Callable[[dict[str, torch.Tensor]], tuple[int, ...]] | None = None  # unused: export shape

    def __post_init__(self):
        if self.kind not in ("rename", "tied", "unused"):
            raise ValueError(f"rule {self.source!r}: unknown kind {self.kind!r}")
        if self.kind == "unused" and self.shape is None:
            raise ValueError(f"rule {self.source!r}: an unused tensor needs a shape for export")


class MappingError(KeyError):
    pass


class NameMap:
    def __init__(self, name: str, rules: list[Rule]):
        self.name = name
        self.rules = rules
        self._src = [(_compile(r.source), r) for r in rules]
        self._dst = [(_compile(r.target), r) for r in rules if r.kind == "rename"]

    @staticmethod
    def _fill(pattern: str, groups: dict[str, str]) -> str:
        return pattern.format(**{k: v for k, v in groups.items() if v is not None})

    def source_to_target(self, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename a source-layout state dict into target names (tied/unused tensors dropped)."""
        out: dict[str, torch.Tensor] = {}
        tied: dict[str, torch.Tensor] = {}
        for key, tensor in source.items():
            hits = [(rx.match(key), r) for rx, r in self._src]
            hits = [(m, r) for m, r in hits if m]
            if len(hits) != 1:
                what = "no rule" if not hits else f"{len(hits)} rules ({[r.source for _, r in hits]})"
                raise MappingError(f"{self.name}: source tensor {key!r} matches {what}")
            m, rule = hits[0]
            if rule.kind == "tied":
                tied[rule.target] = tensor
            if rule.kind != "rename":
                continue
            name = self._fill(rule.target, m.groupdict())
            if name in out:
                raise MappingError(f"{self.name}: two source tensors map to {name!r}")
            out[name] = tensor
        for name, tensor in tied.items():  # a checkpoint may store only the tied copy
            out.setdefault(name, tensor)
        return out

    def target_to_source(self, target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename a target-layout state dict into source names, adding tied copies and unused zeros."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in target.items():
            hits = [(m, r) for rx, r in self._dst if (m := rx.match(key))]
            if len(hits) != 1:
                what = "no rule" if not hits else f"{len(hits)} rules ({[r.target for _, r in hits]})"
                raise MappingError(f"{self.name}: target tensor {key!r} matches {what}")
            m, rule = hits[0]
            out[self._fill(rule.source, m.groupdict())] = tensor
        for rule in self.rules:
            if rule.kind == "tied":
                if rule.target not in target:
                    raise MappingError(f"{self.name}: tied tensor {rule.source!r} needs {rule.target!r}, which is missing")
                out[rule.source] = target[rule.target].clone()
            elif rule.kind == "unused":
                ref = target[rule.target] if rule.target in target else None
                dtype = ref.dtype if ref is not None else torch.float32
                out[rule.source] = torch.zeros(rule.shape(target), dtype=dtype)
        return out
