"""Pieces every ``lf-*`` CLI shares: ``--config NAME_OR_PATH`` plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import sys

from loongforge.core.config import ConfigError


def add_config_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--config", default=default, help=f"config name (shipped) or YAML path (default: {default})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=10 parallel.tp=2")


def normalise_overrides(items: list[str]) -> list[str]:
    """Accept ``--a.b=1`` and ``--a.b 1`` spellings next to ``a.b=1``."""
    out, i = [], 0
    while i < len(items):
        item = items[i]
        if item.startswith("--"):
            item = item[2:]
            if "=" not in item and i + 1 < len(items):
                item = f"{item}={items[i + 1]}"
                i += 1
        out.append(item)
        i += 1
    return out


def run_main(fn) -> int:
    """Run a CLI body; configuration errors print one clear line and exit 2."""
    try:
        return fn() or 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
