"""``Layout``: one Hugging Face architecture of VLM compositions, registered by name under the
``loongforge.vlm.hf_layouts`` entry-point group (``loongforge.vlm.hf.layouts()`` reads them):

    [project.entry-points."loongforge.vlm.hf_layouts"]
    qwen3_vl = "loongforge.vlm.hf_qwen3_vl:LAYOUT"

A package that adds a vision encoder adds its layout the same way, and ``lf-vlm convert``
reads and writes it like a shipped one (``tests/plugin_example``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

LAYOUT_GROUP = "loongforge.vlm.hf_layouts"


@dataclass(frozen=True)
class Layout:
    """One HF architecture of VLM compositions with ``encoder_family`` (and a foundation of one of
    ``foundation_families``; None: any): its whole-checkpoint mapping (``bind(cfg)``), its
    ``config.json`` translation and the ``data`` settings a converted model trains with."""

    name: str
    architecture: str
    encoder_family: str
    foundation_families: tuple[str, ...] | None
    bind: Callable
    config_from_hf: Callable[[dict], object]
    config_to_hf: Callable[[object], dict]
    train_data: Callable[[object], dict] | None = None

    def writes(self, cfg) -> bool:
        return cfg.encoder.family == self.encoder_family and (
            self.foundation_families is None or cfg.foundation.family in self.foundation_families)
