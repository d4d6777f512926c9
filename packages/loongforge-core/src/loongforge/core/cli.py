"""Pieces every ``lf-*`` CLI shares: ``--config NAME_OR_PATH`` plus ``key=value`` overrides, the
``plot`` and ``compare`` subcommands on run directories, and one way to turn configuration errors
into an exit code."""

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


def add_run_commands(sub) -> None:
    """``lf-* plot RUN_DIR`` (the run's loss and throughput curves from ``metrics.jsonl`` to PNG) and
    ``lf-* compare RUN_A RUN_B`` (run B's loss curve relative to run A's, window by window)."""
    plot = sub.add_parser("plot", help="draw the loss/throughput curves of RUN_DIR to PNG")
    plot.add_argument("run_dir")
    plot.set_defaults(fn=_cmd_plot)

    compare = sub.add_parser("compare", help="RUN_B's loss curve relative to RUN_A's, in windows of steps")
    compare.add_argument("run_a", help="the reference run directory")
    compare.add_argument("run_b")
    compare.add_argument("--key", default="loss", help="the metrics.jsonl key to compare (default: loss)")
    compare.add_argument("--window", type=int, default=10, help="logged steps (common to both runs) per window mean (default: 10)")
    compare.add_argument("--from-step", type=int, default=1, help="judge windows starting at this step or later")
    compare.add_argument("--tolerance", type=float, default=None,
                         help="exit 1 when a judged window differs by more than this fraction (e.g. 0.01)")
    compare.set_defaults(fn=_cmd_compare)


def _cmd_plot(args) -> int:
    from loongforge.core.plot import plot_run

    try:
        print(f"wrote {plot_run(args.run_dir)}")
    except (FileNotFoundError, ValueError) as exc:  # no run there, or a malformed metrics line
        raise ConfigError(str(exc)) from exc
    return 0


def _cmd_compare(args) -> int:
    from loongforge.core.compare import compare_runs, format_comparison

    try:
        result = compare_runs(args.run_a, args.run_b, key=args.key, window=args.window)
        worst = result.worst(args.from_step)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc
    print(format_comparison(result, "A", "B", worst, from_step=args.from_step))
    if args.tolerance is not None and worst.distance > args.tolerance:
        if worst.diverged:
            print(f"{worst.difference('A', 'B')} in steps {worst.first_step}-{worst.last_step}", file=sys.stderr)
        else:
            print(f"B is more than {args.tolerance:.2%} from A", file=sys.stderr)
        return 1
    return 0


def run_main(fn) -> int:
    """Run a CLI body; configuration errors print one clear line and exit 2, a run stopped by a
    non-finite loss or gradient norm one line and exit 1."""
    from loongforge.core.training.errors import NonFiniteError

    try:
        return fn() or 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
