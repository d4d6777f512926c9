"""The one CLI builder every ``lf-*`` command uses.

A modality describes itself as a ``ModalityCLI`` (its configs, how a config becomes a task, what
``info`` prints, its ``convert`` directions, its benchmark, its extra commands) and
``build_cli`` turns that into ``main(argv)`` with the same shapes everywhere::

    lf-X train   [--config NAME|PATH] [--nproc-per-node N] [key=value | --key value | group=option ...]
    lf-X train   [--config NAME|PATH] --print-config [key=value ...]   # the resolved config as YAML
    lf-X train   [--config NAME|PATH] --help [key=value ...]           # every key with the run's value
    lf-X info    [--config NAME|PATH] [key=value ...]
    lf-X convert DIRECTION SOURCE OUT [--dtype bf16|fp16|fp32] [--no-progress]
    lf-X convert lora-to-peft CHECKPOINT OUT     # a LoRA run's adapters in PEFT's format (see below)
    lf-X bench   [--config NAME|PATH] [--steps N] [--warmup N] [--variant NAME=KEY=VALUE,...] [key=value ...]
    lf-X plot RUN_DIR | compare RUN_A RUN_B [--window N] [--tolerance F]
    lf-X configs                        # the shipped configs, one line each
    lf-X env                            # versions and devices, for a bug report
    lf-X --version | --debug | --verbose

``train`` loads and validates the config (a bad key or value is one ``error:`` line naming it,
exit 2, before any process group exists), builds the task the config's model family registers,
and runs the shared loop (``loongforge.core.training.run``); ``train --help`` lists every key of
the resolved config with the value the run would use (``config_docs``), marking what an override
changed, and ``train --print-config`` prints the resolved config as YAML. A ``ModalityCLI`` imports
nothing heavy when it is described, and an option hook runs only for its own command, so
``--version``, ``--help`` and ``configs`` import no torch. ``train --nproc-per-node N`` starts the job's N processes
on this machine itself (``loongforge.core.launch``), after checking the config and the layout.
A modality that names its LoRA adapters in a target library (``lora_layouts``:
``loongforge.core.lora.AdapterLayout`` per model part) gets the ``lora-to-peft`` direction of
``convert``, the one implementation in ``loongforge.core.lora``. Every command runs under the error
contract of ``loongforge.core.errors`` (``run_main``), quiet unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loongforge.core.config import ConfigError

# the config groups every lf-* CLI has, with the same keys (tests/test_shared_vocabulary.py); a
# modality's own groups (``balance`` where samples differ in length, ``eval`` where the task has an
# evaluation) are listed by its ``train --help``
SHARED_GROUPS = ("train", "parallel", "checkpoint", "log", "lora")


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
            if item.endswith((".yaml", ".yml")) or Path(item).is_file():
                raise ConfigError(f"cannot parse argument {item!r} (expected key=value); did you mean --config {item}?")
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
    packages: Sequence[str] = field(default_factory=lambda: ["loongforge-core"])  # for --version and env
    libraries: Sequence[str] = ("torch", "megatron-core", "transformers")  # more versions `env` reports
    # (checkpoint manifest, state-dict names) -> loongforge.core.lora.AdapterLayout per model part: how
    # the target library names a LoRA checkpoint's adapters; adds `convert lora-to-peft`
    lora_layouts: Callable[[dict, list[str]], list] | None = None
    lora_library: str = ""  # the target library of lora_layouts, for --help
    module: str = ""  # the module `python -m` runs this CLI from: the workers of `train --nproc-per-node N`
    # shipped configs another command reads ({config name: command}, e.g. a preprocess config): `configs`
    # lists them apart, and `train --config NAME` refuses them naming that command
    command_configs: Mapping[str, str] = field(default_factory=dict)


LORA_TO_PEFT = "lora-to-peft"


def all_converters(app: ModalityCLI) -> list[Converter]:
    """The modality's ``convert`` directions plus the shared ``lora-to-peft`` where it has ``lora_layouts``."""
    converters = list(app.converters)
    layouts = app.lora_layouts
    if layouts is not None:
        def run(source: str, out: str, args: argparse.Namespace) -> str:
            from loongforge.core.lora import export_checkpoint_adapter

            written = export_checkpoint_adapter(source, out, layouts, ema=bool(getattr(args, "ema", False)),
                                                dtype=convert_dtype(args.dtype), command=app.prog)
            return "\n".join(f"wrote {path}" for path in written)

        converters.append(Converter(LORA_TO_PEFT, f"a LoRA checkpoint (or run dir) -> its adapters alone in PEFT's "
                                    f"format (adapter_config.json + adapter_model.safetensors), "
                                    f"{app.lora_library or 'target library'} names", run))
    return converters


def convert_dtype(name: str | None):
    """``convert --dtype``: the torch dtype to cast floating-point weights to (None: keep theirs)."""
    if name is None:
        return None
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def shipped_configs(config_dirs: Sequence[Path], exclude: Collection[str] = ()) -> list[str]:
    return [name for name, _ in describe_configs(config_dirs) if name not in exclude]


def describe_configs(config_dirs: Sequence[Path]) -> list[tuple[str, str]]:
    """``(name, first sentence of its leading comment)`` of every shipped config."""
    out: dict[str, str] = {}
    for d in config_dirs:
        for path in sorted(Path(d).glob("*.y*ml")):
            out.setdefault(path.stem, _first_sentence(path.read_text()))
    return sorted(out.items())


def _first_sentence(text: str) -> str:
    """The first sentence of a YAML file's leading comment paragraph (an indented example command
    or a blank comment line ends the paragraph)."""
    words: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            if words or line.strip():
                break
            continue
        body = line[1:]
        if not body.strip() or body.startswith("   "):
            break
        words.append(body.strip())
    paragraph = " ".join(words)
    end = re.search(r"\.(\s|$)", paragraph)
    sentence = paragraph[:end.start() + 1] if end else paragraph
    return sentence[:-1] + "." if sentence.endswith(":") else sentence  # it introduced an example


def keys_epilog(app: ModalityCLI, config: str | None, cfg: Any, base: Any = None) -> str:
    """``train --help``'s key listing: every key of the resolved config ``cfg`` with the value the run
    would use; a key whose value differs from ``base`` (the config without the command line's
    overrides) is marked with the config's own value."""
    from loongforge.core.config_docs import describe_schema, format_keys

    docs = describe_schema(type(cfg), instance=cfg)
    changed = {}
    if base is not None:
        before = {d.key: d.default for d in describe_schema(type(base), instance=base)}
        changed = {d.key: before.get(d.key, "(not in the config)") for d in docs if before.get(d.key) != d.default}
    source = f"--config {config}" if config else "the defaults"
    return (f"\n\nconfig keys, with the values of {source}{' and the overrides' if base is not None else ''} "
            f"(override any with key=value; `{app.prog} train --print-config [key=value ...]` prints the "
            f"resolved config as YAML):\n" + format_keys(docs, changed=changed))


def _config_epilog(app: ModalityCLI, cfg: Any = None) -> str:
    """The shipped configs, the shared config groups and (given the run's config ``cfg``) the
    modality's own groups."""
    own = [f.name for f in fields(cfg) if f.name not in SHARED_GROUPS] if cfg is not None else []
    return (f"shipped configs: {', '.join(shipped_configs(app.config_dirs, app.command_configs)) or 'none'}\n"
            f"shared config groups (the same keys in every lf-* CLI): {', '.join(SHARED_GROUPS)}\n"
            + (f"{app.prog}'s own config groups: {', '.join(own)}\n" if own else "") +
            f"example: {app.prog} train {app.example}\n"
            f"`{app.prog} info --config NAME [key=value ...]` prints what a config builds.")


def add_config_arguments(parser: argparse.ArgumentParser, default: str | None, default_help: str = "") -> None:
    """``--config NAME|PATH``; the rest of the command line is config overrides (``key=value``,
    ``--key value``, or ``group=option`` to swap a config group), kept in order."""
    parser.add_argument("--config", default=default,
                        help=f"config name (shipped) or YAML path (default: {default_help or default})")
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
    from loongforge.core.environment import package_version

    return ", ".join(f"{name} {package_version(name)}" for name in packages)


def export_converter(app: ModalityCLI) -> Converter | None:
    """The converter ``train --save-FORMAT OUT`` runs at the end of training: the modality's first
    ``lf-to-FORMAT`` direction."""
    return next((c for c in app.converters if c.direction.startswith("lf-to-")), None)


def check_export_target(option: str, out: str, checkpoint_save: bool) -> Path:
    """``--save-FORMAT OUT`` exports the final checkpoint: it must be saved and OUT must be new and
    outside any checkpoint root (checked before any process group)."""
    from loongforge.core.output_paths import check_output_path

    path = check_output_path(out, option)
    if path.exists():
        raise ConfigError(f"{option} {out}: {path} exists; the export writes a new directory")
    if not checkpoint_save:
        raise ConfigError(f"{option} {out} exports the final checkpoint; it needs checkpoint.save=true")
    return path


class _ModalityCommands:
    """The command bodies of one ``ModalityCLI``."""

    def __init__(self, app: ModalityCLI):
        self.app = app
        self.convert_parser: argparse.ArgumentParser | None = None  # set by build_parser
        self.train_parser: argparse.ArgumentParser | None = None

    def _export(self, trainer, converter: Converter, out: Path, progress: bool) -> None:
        """Rank 0 runs ``convert lf-to-FORMAT LAST_CHECKPOINT OUT`` (with that command's defaults)
        once every rank has finished saving."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        if trainer.ctx.is_main and trainer.last_checkpoint is not None:
            argv = [converter.direction, str(trainer.last_checkpoint), str(out)] + ([] if progress else ["--no-progress"])
            assert self.convert_parser is not None  # set by build_parser
            print(converter.run(str(trainer.last_checkpoint), str(out), self.convert_parser.parse_args(argv)),
                  flush=True)

    def config(self, args) -> Any:
        command = self.app.command_configs.get(args.config or "")
        if command is not None:
            raise ConfigError(f"--config {args.config}: a config of `{self.app.prog} {command}`, not of "
                              f"`{self.app.prog} {args.command}` (see `{self.app.prog} configs`)")
        return self.app.load_config(args.config, normalise_overrides(args.overrides))

    def train_help(self, args) -> int:
        """``train --help``: the options, then every key with the value this command line would use."""
        cfg = self.config(args)
        base = None
        if args.overrides:
            try:
                base = self.app.load_config(args.config, [])
            except ConfigError:  # the config needs the overrides (a required key): nothing to compare with
                base = None
        parser = self.train_parser
        assert parser is not None  # set by build_parser
        parser.epilog = _config_epilog(self.app, cfg) + keys_epilog(self.app, args.config, cfg, base)
        parser.print_help()
        return 0

    def train(self, args) -> int:
        if args.show_help:
            return self.train_help(args)
        cfg = self.config(args)  # fails here, before any process group, on a bad config
        if args.print_config:
            from loongforge.core.config import to_yaml

            print(to_yaml(cfg), end="")
            return 0
        return self._train(args, cfg)

    def _train(self, args, cfg) -> int:
        from loongforge.core.training.run import run_training
        from loongforge.core.training.run_dir import check_run_directories
        from loongforge.core.wandb_run import require_wandb

        app = self.app
        check_run_directories(cfg)  # and on a log.run_dir or checkpoint.dir that is a file
        if args.nproc_per_node != 1:
            return self._launch(args, cfg)
        require_wandb(cfg.log)  # and here when log.wandb=true has no wandb to log to
        state = app.before_train(args, cfg) if app.before_train is not None else None
        converter = export_converter(app)
        save_to = getattr(args, "save_export", None)
        if save_to is not None:
            assert converter is not None  # --save-FORMAT is an option only where there is one
            option = "--save-" + converter.direction.removeprefix("lf-to-")
            save_to = check_export_target(option, save_to, cfg.checkpoint.save)
        task = app.make_task(cfg)  # the family's task: its data and tokenizer checks come before any group too

        def after(trainer) -> None:
            if app.after_train is not None:
                app.after_train(args, cfg, state, trainer)
            if save_to is not None and converter is not None:
                self._export(trainer, converter, save_to, cfg.log.progress)

        summary = run_training(cfg, task, app.prog, after=after)
        export = next((c.direction for c in all_converters(app) if c.direction.startswith("lf-to-")), None)
        if export and summary.last_checkpoint is not None and summary.is_main:
            print(f"{app.prog}: export: {app.prog} convert {export} {summary.last_checkpoint} OUT", flush=True)
        return 0

    def _launch(self, args, cfg) -> int:
        """``train --nproc-per-node N``: the layout checked against N, then N workers of this command."""
        from loongforge.core.distributed import world_size_from_env
        from loongforge.core.launch import FLAG, check_not_launched, launch_local, worker_argv
        from loongforge.core.parallel import ParallelLayout

        n = args.nproc_per_node
        if n < 1 or not self.app.module:
            raise ConfigError(f"{FLAG} {n}: " + ("must be >= 1" if n < 1 else f"{self.app.prog} starts no workers"))
        check_not_launched(n, world_size_from_env())
        p = cfg.parallel
        ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep).validate(n)
        return launch_local(self.app.module, worker_argv(args.argv), n, verbose=args.verbose or args.debug,
                            prog=self.app.prog)

    def info(self, args) -> int:
        self.app.info(args, self.config(args))
        return 0

    def convert(self, args) -> int:
        from loongforge.core.output_paths import check_output_path

        converter = next(c for c in all_converters(self.app) if c.direction == args.direction)
        check_output_path(args.out, f"convert {args.direction} OUT")
        source = args.source
        if args.direction.startswith("hf-to-"):  # a Hugging Face model: a directory or a hub id
            from loongforge.core.hub import resolve_local

            source = resolve_local(source, key=f"convert {args.direction} SOURCE")
        try:
            print(converter.run(source, args.out, args))
        except (FileNotFoundError, FileExistsError) as exc:  # a missing source, an output that exists
            raise ConfigError(str(exc)) from exc
        return 0

    def bench(self, args) -> int:
        from loongforge.core.bench_protocol import check_protocol
        from loongforge.core.benchmarking import check_timing

        check_timing(args.steps, args.warmup)
        check_protocol(args.rounds, args.processes)
        config = args.config
        if config is None:  # the GPU case, or the default config where the accelerator is the CPU
            from loongforge.core.accelerators import get_accelerator

            config = self.app.default_bench_config
            if get_accelerator().device_type == "cpu":
                config = self.app.default_config
                print(f"{self.app.prog} bench: no GPU here: --config {config} (on a GPU the default is "
                      f"{self.app.default_bench_config})", flush=True)
        assert self.app.bench is not None  # `bench` is a command only where there is one
        self.app.bench(args, config, normalise_overrides(args.overrides))
        return 0


def selected_command(argv: Sequence[str]) -> str | None:
    """The subcommand of a command line: its first argument that is not an option (the top-level
    options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(app: ModalityCLI, chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``app``'s CLI. ``chosen``: the subcommand the command line runs; only its own
    options are added (what a modality's option hooks import is imported only for the command that
    needs it), every command's when None."""
    commands = _ModalityCommands(app)

    def wanted(name: str) -> bool:
        return chosen is None or chosen == name

    parser = argparse.ArgumentParser(prog=app.prog, description=app.description, allow_abbrev=False,
                                     epilog=_config_epilog(app), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_versions(app.packages))
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error too (or set {DEBUG_ENV}=1); implies --verbose")
    parser.add_argument("--verbose", action="store_true", help="show the libraries' warnings and log records")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, more_epilog: str = "", **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, allow_abbrev=False, epilog=_config_epilog(app) + more_epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    usage = "%(prog)s [--config NAME|PATH] [--print-config] [key=value | --key value | group=option ...]"
    train = command("train", f"train (no arguments: {app.default_config})", usage=usage, add_help=False)
    commands.train_parser = train
    train.add_argument("-h", "--help", dest="show_help", action="store_true",
                       help="show this help and every config key with the value the run would use (with "
                            "--config and the overrides given), then exit")
    add_config_arguments(train, app.default_config)
    train.add_argument("--print-config", action="store_true",
                       help="print the resolved config (--config, group choices and overrides applied) as YAML, "
                            "then exit without training")
    train.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                       help="start the job's N processes on this machine (as torchrun --standalone would), "
                            "after checking the config and the layout; for several machines use torchrun")
    converter = export_converter(app)
    if converter is not None:
        fmt = converter.direction.removeprefix("lf-to-")
        train.add_argument(f"--save-{fmt}", dest="save_export", metavar="OUT", default=None,
                           help=f"at the end, also write the final checkpoint to OUT as `{app.prog} convert "
                                f"{converter.direction}` does")
    if app.train_options is not None and wanted("train"):
        app.train_options(train)
    train.set_defaults(fn=commands.train)

    info = command("info", "what a config builds: parts, parameters, FLOPs (nothing is allocated)", usage=usage)
    add_config_arguments(info, app.default_config)
    if app.info_options is not None and wanted("info"):
        app.info_options(info)
    info.set_defaults(fn=commands.info)

    converters = all_converters(app)
    if converters:
        conv = sub.add_parser("convert", help="convert checkpoints: " + ", ".join(c.direction for c in converters),
                              allow_abbrev=False)
        conv.add_argument("direction", choices=[c.direction for c in converters],
                          help="; ".join(f"{c.direction}: {c.help}" for c in converters))
        conv.add_argument("source", help="what the direction converts from (an hf-to-* SOURCE may be a Hugging Face "
                                          "Hub id, owner/name[@revision], resolved from the hub cache or downloaded)")
        conv.add_argument("out", help="output path (must not exist)")
        conv.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point weights (default: keep)")
        conv.add_argument("--no-progress", action="store_true", help="no progress bar")
        # train --save-FORMAT runs the converter with convert's parser: its options too
        if app.convert_options is not None and (wanted("convert") or wanted("train")):
            app.convert_options(conv)
        conv.set_defaults(fn=commands.convert)
        commands.convert_parser = conv

    if app.bench is not None:
        bench = command("bench", "time our training step against the reference implementation, in one process",
                        usage="%(prog)s [--config NAME|PATH] [--steps N] [--warmup N] [--variant NAME=KEY=VALUE,...] "
                              "[key=value ...]")
        if app.default_bench_config:  # a GPU case: where no GPU is, the default config instead
            add_config_arguments(bench, None, f"{app.default_bench_config} on a GPU, {app.default_config} without one")
        else:
            add_config_arguments(bench, app.default_config)
        bench.add_argument("--steps", type=int, default=10, help="timed steps per run")
        bench.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
        bench.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                           help="one more run of ours with these config overrides (repeatable)")
        if wanted("bench"):
            from loongforge.core.bench_protocol import add_protocol_arguments

            add_protocol_arguments(bench)  # --rounds, --processes
        bench.add_argument("--profile-rows", type=int, default=25,
                           help="rows of the torch.profiler tables of ours (top kernels and ops, on CUDA); 0: none")
        bench.add_argument("--trace", default=None, metavar="FILE", help="also write a Chrome trace of ours' profiled steps")
        if app.bench_options is not None and wanted("bench"):
            app.bench_options(bench)
        bench.set_defaults(fn=commands.bench)

    configs = sub.add_parser("configs", help="the shipped configs, one line each")
    configs.set_defaults(fn=lambda args: _cmd_configs(app))
    env = sub.add_parser("env", help="versions and devices, to paste into a bug report")
    env.set_defaults(fn=lambda args: _cmd_env(app))

    if app.commands is not None:
        app.commands(sub)
    add_run_commands(sub)
    return parser


def _cmd_configs(app: ModalityCLI) -> int:
    described = describe_configs(app.config_dirs)
    width = max((len(name) for name, _ in described), default=0)
    for name, line in described:
        if name not in app.command_configs:
            print(f"{name:<{width}}  {line}")
    print(f"\n{app.prog} train --config NAME [key=value ...]; {app.prog} info --config NAME shows what it builds")
    for name, line in described:
        if name in app.command_configs:
            print(f"for {app.prog} {app.command_configs[name]}: {name}  {line}")
    return 0


def _cmd_env(app: ModalityCLI) -> int:
    import platform

    from loongforge.core.environment import describe_environment

    print(f"{app.prog} environment")
    print(f"python: {platform.python_version()} ({sys.executable})")
    print(f"platform: {platform.platform()}")
    for key, value in describe_environment([*app.packages, *app.libraries, "triton"]):
        print(f"{key}: {value}")
    return 0


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Commands that take config overrides take every argument they do not define, in order."""
    args, extra = parser.parse_known_args(argv)
    for flag in ("--debug", "--verbose"):  # accepted after the command too (``lf-X train --debug``)
        if flag in extra:
            extra = [a for a in extra if a != flag]
            setattr(args, flag[2:], True)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    args.argv = list(argv)
    return args


def build_cli(make_app: Callable[[], ModalityCLI]) -> Callable[[list[str] | None], int]:
    """``main(argv)`` of a modality's ``lf-*`` command; ``make_app()`` describes the modality (it is
    called inside the quiet scope, so what its imports print is quiet too)."""

    def main(argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else list(argv)
        debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
        with library_output(verbose="--verbose" in argv or debug):
            app = make_app()
            # no subcommand (--version, --help): no command's own options are needed
            args = _parse(build_parser(app, selected_command(argv) or ""), argv)
            return run_main(lambda: args.fn(args), debug=debug, prog=app.prog)

    return main


DEBUG_ENV = "LOONGFORGE_DEBUG"
# the libraries whose import-time warnings and WARNING log records a normal run does not show.
# torch sets its own "torch" logger's level when it is imported (torch._logging), so a command that
# imports torch inside the quiet scope gets it back at WARNING: the torch loggers that warn at import
# are named too (torch.utils.cpp_extension, imported by megatron-core, warns "No CUDA runtime is
# found" on a machine with a CUDA toolkit and no GPU)
LIBRARY_LOGGERS = ("megatron", "torch", "torch.utils.cpp_extension", "transformers", "diffusers", "lerobot",
                   "torchcodec", "huggingface_hub", "datasets", "accelerate")
RANK_REPORT_DELAY_S = 10.0


@contextmanager
def library_output(verbose: bool):
    """Quiet libraries (the default): warnings raised outside ``loongforge`` and the libraries'
    WARNING log records are not shown, so a run's first lines are ours; ``verbose`` shows them.
    Everything is restored on exit."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(?!loongforge)")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def report_error(message: str) -> None:
    """One ``error:`` line on stderr, once per job: a rank other than 0 waits a moment first, so that
    when every rank fails alike, rank 0's line is the one shown (its exit makes the launcher stop the
    others); a rank that fails alone still reports, tagged with its rank."""
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank:
        time.sleep(RANK_REPORT_DELAY_S)
        message = f"[rank {rank}] {message}"
    print(f"error: {message}", file=sys.stderr, flush=True)


def run_main(fn, debug: bool = False, prog: str | None = None) -> int:
    """Run a CLI body under the error contract (``loongforge.core.errors``): a ``UserError`` and a
    file system refusal (disk full, read-only, permission) print one ``error:``
    line and exit 2; a run stopped by a non-finite loss, gradient norm or weights prints one line
    and exits 1; a run stopped by a signal (``training.preemption``; it has said so) exits 75
    (SIGTERM, SIGUSR1: requeue) or 130 (Ctrl-C); Ctrl-C anywhere else is one line and exit 130;
    anything else is a bug and keeps its traceback. ``debug``: every traceback shown."""
    from loongforge.core.errors import UserError, storage_error
    from loongforge.core.training.errors import NonFiniteError, TrainingStopped
    from loongforge.core.training.preemption import INTERRUPT_EXIT_CODE

    try:
        return fn() or 0
    except TrainingStopped as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        if not int(os.environ.get("RANK", "0") or 0):  # once per job
            print(f"{prog + ': ' if prog else ''}interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return INTERRUPT_EXIT_CODE
    except UserError as exc:
        if debug:
            raise
        report_error(str(exc))
        return 2
    except NonFiniteError as exc:
        if debug:
            raise
        report_error(str(exc))
        return 1
    except OSError as exc:
        refused = storage_error(exc, "cannot write" if exc.filename else "a file operation failed")
        if refused is None or debug:
            raise
        report_error(str(refused))
        return 2
    except Exception as exc:
        distributed = sys.modules.get("loongforge.core.distributed")  # loaded once the job has groups
        failure = distributed.collective_failure(exc) if distributed is not None else None
        if failure is None or debug:
            raise
        report_error(failure)
        return 1
