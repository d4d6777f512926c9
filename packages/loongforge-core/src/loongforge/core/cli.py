"""The one CLI builder every ``lf-*`` command uses.

A modality describes itself as a ``ModalityCLI`` (its configs, how a config becomes a task, what
``info`` prints, its ``convert`` directions, its benchmark, its extra commands) and
``build_cli`` turns that into ``main(argv)`` with the same shapes everywhere::

    lf-X train   [--config NAME|PATH] [key=value | --key value | group=option ...]
    lf-X info    [--config NAME|PATH] [key=value ...]
    lf-X convert DIRECTION SOURCE OUT [--dtype bf16|fp16|fp32] [--no-progress]
    lf-X bench   [--config NAME|PATH] [--steps N] [--warmup N] [--variant NAME=KEY=VALUE,...] [key=value ...]
    lf-X plot RUN_DIR | compare RUN_A RUN_B [--window N] [--tolerance F]
    lf-X --version

``train`` loads and validates the config (a bad key or value is one ``error:`` line naming it,
exit 2, before any process group exists), builds the task the config's model family registers,
and runs the shared loop (``loongforge.core.training.run``). A run stopped by a non-finite loss
or gradient norm is one ``error:`` line and exit 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongforge.core.config import ConfigError

SHARED_GROUPS = ("train", "parallel", "checkpoint", "log", "balance", "eval")


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


@dataclass(frozen=True)
class Converter:
    """One direction of ``lf-X convert``: ``run(source, out, args)`` converts and returns the line to print."""

    direction: str  # e.g. "hf-to-lf", "lf-to-diffusers"
    help: str
    run: Callable[[str, str, argparse.Namespace], str]


@dataclass
class ModalityCLI:
    prog: str
    description: str
    config_dirs: Sequence[Path]
    default_config: str
    load_config: Callable[[str | None, list[str]], Any]  # (name or path, overrides) -> validated run config
    make_task: Callable[[Any], Any]  # run config -> the task of its model family (through the registry)
    info: Callable[[argparse.Namespace, Any], None]  # prints what `info` shows for a config
    info_options: Callable[[argparse.ArgumentParser], None] | None = None
    example: str = "train.steps=10 train.lr=1e-4"  # overrides shown in --help
    converters: Sequence[Converter] = ()
    convert_options: Callable[[argparse.ArgumentParser], None] | None = None
    train_options: Callable[[argparse.ArgumentParser], None] | None = None
    # (args, cfg) -> state, run after the config is loaded and before any process group (checks of
    # train options); after_train(args, cfg, state, trainer) runs once training has finished
    before_train: Callable[[argparse.Namespace, Any], Any] | None = None
    after_train: Callable[[argparse.Namespace, Any, Any, Any], None] | None = None
    bench_options: Callable[[argparse.ArgumentParser], None] | None = None
    bench: Callable[[argparse.Namespace, str | None, list[str]], None] | None = None  # (args, config, overrides)
    default_bench_config: str | None = None
    commands: Callable[[Any], None] | None = None  # adds the modality's own subcommands (fn(args) -> int)
    errors: tuple[type[BaseException], ...] = ()  # more exceptions printed as one error line (exit 2)
    packages: Sequence[str] = field(default_factory=lambda: ["loongforge-core"])  # for --version


def convert_dtype(name: str | None):
    """``convert --dtype``: the torch dtype to cast floating-point weights to (None: keep theirs)."""
    if name is None:
        return None
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def shipped_configs(config_dirs: Sequence[Path]) -> list[str]:
    return sorted({p.stem for d in config_dirs for p in Path(d).glob("*.y*ml")})


def _config_epilog(app: ModalityCLI) -> str:
    return (f"shipped configs: {', '.join(shipped_configs(app.config_dirs)) or 'none'}\n"
            f"shared config groups (the same keys in every lf-* CLI): {', '.join(SHARED_GROUPS)}\n"
            f"example: {app.prog} train {app.example}\n"
            f"`{app.prog} info --config NAME [key=value ...]` prints what a config builds.")


def add_config_arguments(parser: argparse.ArgumentParser, default: str | None) -> None:
    """``--config NAME|PATH``; the rest of the command line is config overrides (``key=value``,
    ``--key value``, or ``group=option`` to swap a config group), kept in order."""
    parser.add_argument("--config", default=default,
                        help=f"config name (shipped) or YAML path (default: {default})")
    parser.set_defaults(takes_overrides=True)


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


def _versions(packages: Sequence[str]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in packages:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


class _ModalityCommands:
    """The command bodies of one ``ModalityCLI``."""

    def __init__(self, app: ModalityCLI):
        self.app = app

    def config(self, args) -> Any:
        return self.app.load_config(args.config, normalise_overrides(args.overrides))

    def train(self, args) -> int:
        from loongforge.core.training.run import run_training

        app = self.app
        cfg = self.config(args)  # fails here, before any process group, on a bad config
        state = app.before_train(args, cfg) if app.before_train is not None else None
        task = app.make_task(cfg)  # the family's task: its data and tokenizer checks come before any group too
        after = (lambda trainer: app.after_train(args, cfg, state, trainer)) if app.after_train is not None else None
        run_training(cfg, task, app.prog, after=after)
        return 0

    def info(self, args) -> int:
        self.app.info(args, self.config(args))
        return 0

    def convert(self, args) -> int:
        converter = next(c for c in self.app.converters if c.direction == args.direction)
        try:
            print(converter.run(args.source, args.out, args))
        except (FileNotFoundError, FileExistsError) as exc:  # a missing source, an output that exists
            raise ConfigError(str(exc)) from exc
        return 0

    def bench(self, args) -> int:
        self.app.bench(args, args.config, normalise_overrides(args.overrides))
        return 0


def build_parser(app: ModalityCLI) -> argparse.ArgumentParser:
    commands = _ModalityCommands(app)
    parser = argparse.ArgumentParser(prog=app.prog, description=app.description, allow_abbrev=False,
                                     epilog=_config_epilog(app), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_versions(app.packages))
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, allow_abbrev=False, epilog=_config_epilog(app),
                              formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    usage = "%(prog)s [--config NAME|PATH] [key=value | --key value | group=option ...]"
    train = command("train", f"train (no arguments: {app.default_config})", usage=usage)
    add_config_arguments(train, app.default_config)
    if app.train_options is not None:
        app.train_options(train)
    train.set_defaults(fn=commands.train)

    info = command("info", "what a config builds: parts, parameters, FLOPs (nothing is allocated)", usage=usage)
    add_config_arguments(info, app.default_config)
    if app.info_options is not None:
        app.info_options(info)
    info.set_defaults(fn=commands.info)

    if app.converters:
        conv = sub.add_parser("convert", help="convert checkpoints: " + ", ".join(c.direction for c in app.converters),
                              allow_abbrev=False)
        conv.add_argument("direction", choices=[c.direction for c in app.converters],
                          help="; ".join(f"{c.direction}: {c.help}" for c in app.converters))
        conv.add_argument("source")
        conv.add_argument("out", help="output path (must not exist)")
        conv.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point weights (default: keep)")
        conv.add_argument("--no-progress", action="store_true", help="no progress bar")
        if app.convert_options is not None:
            app.convert_options(conv)
        conv.set_defaults(fn=commands.convert)

    if app.bench is not None:
        bench = command("bench", "time our training step against the reference implementation, in one process",
                        usage="%(prog)s [--config NAME|PATH] [--steps N] [--warmup N] [--variant NAME=KEY=VALUE,...] "
                              "[key=value ...]")
        add_config_arguments(bench, app.default_bench_config or app.default_config)
        bench.add_argument("--steps", type=int, default=10, help="timed steps per run")
        bench.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
        bench.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                           help="one more run of ours with these config overrides (repeatable)")
        if app.bench_options is not None:
            app.bench_options(bench)
        bench.set_defaults(fn=commands.bench)

    if app.commands is not None:
        app.commands(sub)
    add_run_commands(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Commands that take config overrides take every argument they do not define, in order."""
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    return args


def build_cli(app: ModalityCLI) -> Callable[[list[str] | None], int]:
    """``main(argv)`` of the modality's ``lf-*`` command."""

    def main(argv: list[str] | None = None) -> int:
        args = _parse(build_parser(app), sys.argv[1:] if argv is None else list(argv))
        return run_main(lambda: args.fn(args), errors=app.errors)

    return main


def run_main(fn, errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a CLI body. A configuration error, or one of ``errors`` (bad data, a checkpoint or
    mapping that cannot be read, an output that exists), prints one ``error:`` line and exits 2;
    a run stopped by a non-finite loss or gradient norm prints one line and exits 1."""
    from loongforge.core.checkpoint.pieces import CheckpointReadError
    from loongforge.core.training.errors import NonFiniteError

    try:
        return fn() or 0
    except (ConfigError, CheckpointReadError, *errors) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
