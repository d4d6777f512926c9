"""``lf-embodied``: the shared ``lf-*`` commands (train, info, convert, bench, plot, compare) for
VLA policies, plus ``eval``.

    lf-embodied train [--config NAME|PATH] [--model pi0|pi05|smolvla|groot_n1_7|pi05_dit_head] [--data.path PATH] [key=value ...]
    lf-embodied eval --checkpoint RUN_DIR|CKPT_DIR [--data.path PATH] [key=value ...]
    lf-embodied convert lf-to-lerobot CHECKPOINT OUT.safetensors|OUT_DIR | lerobot-to-lf LEROBOT.safetensors|LEROBOT_DIR OUT.safetensors
    lf-embodied convert lora-to-peft CHECKPOINT OUT    # a LoRA run's adapters, for PEFT on LeRobot's policy
    lf-embodied bench [--against-lerobot [--lerobot-compile-mode MODE|none]] [--batch-size B] [--steps N] [--rounds R]
                      [--processes P] [--variant NAME=KEY=VALUE,...] [key=value ...]

``train`` with no arguments trains the tiny Pi0.5-style policy on a synthetic LeRobot dataset
(written to the cache directory on first use) on the current accelerator, resuming from
``RUN_DIR/checkpoints/latest`` if a previous run left one. Launch several processes with
``torchrun --nproc-per-node N -m loongforge.embodied.cli train parallel.data_parallel=fsdp``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loongforge.core.cli import normalise_overrides
from loongforge.embodied.config import make_task

CONFIG_DIR = Path(__file__).parent / "configs"


def load_config(name_or_path: str | None, overrides: list[str]):
    from loongforge.embodied.config import load_train_config

    return load_train_config(name_or_path, overrides)


def cmd_info(args, cfg) -> None:
    import torch

    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.config import to_yaml
    from loongforge.embodied.policies import build_policy

    with torch.device("meta"):  # shapes only: released sizes need no memory
        policy = build_policy(cfg.model)
    n = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    print(to_yaml(cfg))
    print(f"policy {cfg.model.family}: {n:,} parameters ({trainable:,} trainable); accelerator {get_accelerator()}; "
          f"torch {torch.__version__}")


def cmd_eval(args) -> int:
    from loongforge.embodied.evaluation import evaluate_checkpoint

    print(json.dumps(evaluate_checkpoint(args.checkpoint, normalise_overrides(args.overrides)), indent=1, sort_keys=True))
    return 0


def bench_options(parser) -> None:
    parser.add_argument("--against-lerobot", action="store_true", help="also time LeRobot's PI05Pytorch (needs model=pi05_base)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples a step (train.global_batch_size; default: the config's)")
    parser.add_argument("--lerobot-compile-mode", default=None,
                        help="with --against-lerobot: a torch.compile mode for LeRobot's PI05 other than its own default, "
                             "or 'none' (LeRobot uncompiled)")


def bench(args, config: str, overrides: list[str]) -> None:
    from loongforge.core.bench_protocol import repeat_in_processes
    from loongforge.core.config import ConfigError
    from loongforge.embodied.bench import (
        BASELINE,
        LEROBOT_COMPILE_MODE,
        bench_from_config,
        lerobot_recipe,
        load_runs,
        results_lines,
        step_seconds_from_config,
    )

    load_runs(config, overrides, args.variant)  # a bad variant or compile mode fails before any run
    if args.lerobot_compile_mode is not None and not args.against_lerobot:
        raise ConfigError("--lerobot-compile-mode compiles LeRobot's side: it needs --against-lerobot")
    compile_mode = args.lerobot_compile_mode or LEROBOT_COMPILE_MODE
    lerobot_recipe(compile_mode)
    kwargs = dict(config=config, overrides=overrides, variants=args.variant, batch_size=args.batch_size,
                  steps=args.steps, warmup=args.warmup, rounds=args.rounds, against_lerobot=args.against_lerobot,
                  lerobot_compile_mode=compile_mode)
    if args.processes > 1:
        return repeat_in_processes(step_seconds_from_config, kwargs, args.processes, [BASELINE])
    results = bench_from_config(**kwargs, profile_rows=args.profile_rows, trace=args.trace)
    print("\n".join(results_lines(results)))
    print(json.dumps({name: vars(r) for name, r in results.items()}, indent=1))


def lf_to_lerobot(source: str, out: str, args) -> str:
    from loongforge.core.cli import convert_dtype
    from loongforge.embodied.export import export_lerobot

    written, note = export_lerobot(source, out, dtype=convert_dtype(args.dtype))
    return f"wrote {written}{note}"


def lerobot_to_lf(source: str, out: str, args) -> str:
    from loongforge.embodied.export import import_lerobot

    return f"wrote {import_lerobot(source, out)}"


def lora_layouts(manifest: dict, names: list[str]):
    from loongforge.embodied.export import lora_layouts as layouts

    return layouts(manifest, names)


def commands(sub) -> None:
    p = sub.add_parser("eval", help="run the evaluation hook (eval.hook) on a checkpoint", allow_abbrev=False)
    p.add_argument("--checkpoint", required=True, help="a run directory or checkpoint directory")
    p.set_defaults(fn=cmd_eval, takes_overrides=True)


def describe_cli():
    """This package's ``ModalityCLI`` (``loongforge.core.cli``)."""
    from loongforge.core.cli import Converter, ModalityCLI

    return ModalityCLI(
        prog="lf-embodied", module="loongforge.embodied.cli", description="LoongForge embodied (VLA) policies",
        config_dirs=[CONFIG_DIR], default_config="train", load_config=load_config, make_task=make_task,
        info=cmd_info, example="--model smolvla data.path=/data/lerobot_dataset train.steps=2000",
        converters=[Converter("lf-to-lerobot", "a checkpoint (or run dir) of a policy with a LeRobot layout (pi0, pi05, smolvla, "
                              "groot_n1_7's head) -> LeRobot's model.safetensors (a LoRA run's adapters merged)", lf_to_lerobot),
                    Converter("lerobot-to-lf", "a LeRobot policy's model.safetensors (pi0, pi05, smolvla, groot's N1.7 head) -> "
                              "the same weights in LoongForge names (for model.pretrained)", lerobot_to_lf)],
        bench_options=bench_options, bench=bench, commands=commands, lora_layouts=lora_layouts, lora_library="LeRobot",
        packages=["loongforge-core", "loongforge-embodied", "loongforge-kernels"],
        libraries=("torch", "lerobot", "transformers"),
    )


def main(argv: list[str] | None = None) -> int:
    from loongforge.core.cli import build_cli

    return build_cli(describe_cli)(argv)


if __name__ == "__main__":
    sys.exit(main())
