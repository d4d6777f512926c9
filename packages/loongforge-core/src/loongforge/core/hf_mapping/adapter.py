"""A model family's Hugging Face adapter (``ModelSpec.hf_adapter``): which HF architectures
it reads, its mapping table and the translation of ``config.json`` to its model config and
back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loongforge.core.hf_mapping.table import BoundMapping, HFMapping
from loongforge.core.hf_mapping.transforms import MappingError


@dataclass(frozen=True)
class HFAdapter:
    """``config_from_hf(config_json: dict) -> model config`` raises ``MappingError`` naming
    the key of a feature the family does not support; ``config_to_hf(model config) -> dict``
    is the ``config.json`` to write (``architectures`` included)."""

    architectures: tuple[str, ...]
    mapping: HFMapping
    config_from_hf: Callable[[dict], Any]
    config_to_hf: Callable[[Any], dict]

    def bind(self, cfg: Any) -> BoundMapping:
        return self.mapping.bind(cfg)


def family_for_architectures(architectures: list[str] | None, source: str = "config.json") -> tuple[str, HFAdapter]:
    """The installed ``(family name, adapter)`` that reads one of ``architectures``: a family that
    declares it under ``loongforge.hf_architectures`` (that family alone is loaded), else any
    installed family whose adapter lists it (every family is loaded)."""
    from loongforge.core.models import declared_for_architecture, installed_models

    for arch in architectures or []:
        readers = [spec for spec in declared_for_architecture(arch)
                   if isinstance(spec.hf_adapter, HFAdapter) and arch in spec.hf_adapter.architectures]
        if len({spec.name for spec in readers}) > 1:
            raise MappingError(f"{source}: architecture {arch!r} is declared by several installed model families "
                               f"({', '.join(sorted({spec.name for spec in readers}))}); uninstall all but one")
        if readers:
            return readers[0].name, readers[0].hf_adapter
    known = {arch: (name, spec.hf_adapter) for name, spec in sorted(installed_models().items())
             if isinstance(spec.hf_adapter, HFAdapter) for arch in spec.hf_adapter.architectures}
    for arch in architectures or []:
        if arch in known:
            return known[arch]
    raise MappingError(f"{source}: architectures {architectures!r} are not supported by any installed model family; "
                       f"supported: {', '.join(sorted(known)) or 'none'}")
