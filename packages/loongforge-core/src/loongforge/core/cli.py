"""Pieces every ``lf-*`` CLI shares: ``--config NAME_OR_PATH`` plus ``key=value`` overrides, the
``plot`` subcommand, and one way to turn configuration errors into an exit code."""

from __future__ import annotations

import argparse
import sys

from loongforge.core.config import ConfigError


def add_config_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--config", default=default, help=f"config name (shipped) or YAML path (default: {default})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=10 parallel.tp=2")


def normalise_overrides(items: list[str]) -> list[str]:
    """``--a.b VALUE`` / ``--a.b=VALUE`` / ``a.b=VALUE`` -> ``a.b=VALUE``; anything else is an error."""
    out, i = [], 0
    while i < len(items):
        item = items[i]
        if item.startswith("--"):
            item = item[2:]
            if "=" not in item:
                if i + 1 >= len(items):
                    raise ConfigError(f"--{item} needs a value")
                item = f"{item}={items[i + 1]}"
                i += 1
        elif "=" not in item:
            raise ConfigError(f"cannot parse argument {item!r} (expected key=value)")
        out.append(item)
        i += 1
    return out


def add_plot_command(sub) -> None:
    """``lf-* plot RUN_DIR``: the run's loss and throughput curves from ``metrics.jsonl`` to PNG."""
    plot = sub.add_parser("plot", help="draw the loss/throughput curves of RUN_DIR to PNG")
    plot.add_argument("run_dir")
    plot.set_defaults(fn=_cmd_plot)


def _cmd_plot(args) -> int:
    from loongforge.core.plot import plot_run

    print(f"wrote {plot_run(args.run_dir)}")
    return 0


def run_main(fn) -> int:
    """Run a CLI body; configuration errors print one clear line and exit 2."""
    try:
        return fn() or 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
