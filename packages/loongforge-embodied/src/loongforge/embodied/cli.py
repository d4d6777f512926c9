"""``lf-embodied``: train, eval, export and convert VLA policies.

    lf-embodied train [--config NAME|PATH] [--policy pi05|groot] [--data.root PATH] [key=value ...]
    lf-embodied eval --checkpoint RUN_DIR|CKPT_DIR [--data.root PATH] [key=value ...]
    lf-embodied export --checkpoint RUN_DIR|CKPT_DIR --out FILE.safetensors [--format loongforge|lerobot]
    lf-embodied convert --from-lerobot FILE.safetensors --out FILE.safetensors
    lf-embodied info [--config NAME|PATH] [key=value ...]
    lf-embodied bench [--against-lerobot] [--batch-size B] [--steps N] [key=value ...]
    lf-embodied plot RUN_DIR
    lf-embodied compare RUN_A RUN_B [--key loss] [--window N] [--from-step S] [--tolerance F]

``train`` with no arguments trains the tiny Pi0.5-style policy on a synthetic LeRobot dataset
(written to the cache directory on first use) on the current accelerator, resuming from
``RUN_DIR/checkpoints/latest`` if a previous run left one. Launch several processes with
``torchrun --nproc-per-node N -m loongforge.embodied.cli train parallel.data_parallel=fsdp``.
"""

from __future__ import annotations

import argparse
import json
import sys

from loongforge.core.cli import add_run_commands, normalise_overrides, run_main


def _config(args, rest):
    from loongforge.embodied.config import load_train_config

    return load_train_config(args.config, normalise_overrides(rest))


def cmd_train(args, rest) -> int:
    from loongforge.core.models import get_model_spec
    from loongforge.core.training.run import run_training

    cfg = _config(args, rest)  # fails here, before any process group, on a bad config
    run_training(cfg, get_model_spec(cfg.policy.family).make_task(cfg), "lf-embodied")
    return 0


def cmd_eval(args, rest) -> int:
    from loongforge.embodied.evaluation import evaluate_checkpoint

    print(json.dumps(evaluate_checkpoint(args.checkpoint, normalise_overrides(rest)), indent=1, sort_keys=True))
    return 0


def cmd_export(args, rest) -> int:
    from loongforge.embodied.export import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.out, fmt=args.format)
    print(f"wrote {path}")
    return 0


def cmd_convert(args, rest) -> int:
    from loongforge.embodied.export import convert_lerobot_file

    print(f"wrote {convert_lerobot_file(args.from_lerobot, args.out)}")
    return 0


def cmd_info(args, rest) -> int:
    import torch

    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.config import to_yaml
    from loongforge.core.models import get_model_spec

    cfg = _config(args, rest)
    with torch.device("meta"):  # shapes only: released sizes need no memory
        policy = get_model_spec(cfg.policy.family).build(cfg.policy)
    n = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    print(to_yaml(cfg))
    print(f"policy {cfg.policy.family}: {n:,} parameters ({trainable:,} trainable); accelerator {get_accelerator()}; torch {torch.__version__}")
    return 0


def cmd_bench(args, rest) -> int:
    import torch

    from loongforge.core.distributed import init_distributed
    from loongforge.embodied.bench import (
        build_lerobot_pi05_released,
        lerobot_step,
        loongforge_step,
        samples_per_second,
        synthetic_batch,
    )
    from loongforge.core.models import get_model_spec
    from loongforge.core.training.engine import resolve_dtype

    cfg = _config(args, rest)
    env = init_distributed(group_for_world_of_one=False)
    batch = synthetic_batch(cfg.policy, args.batch_size, env.device)
    sync = env.accelerator.synchronize
    dtype = resolve_dtype(cfg.train.precision, env.device)
    report = {"policy": cfg.policy.family, "batch_size": args.batch_size, "image_size": cfg.policy.image_size,
              "device": str(env.device), "precision": str(dtype), "compile": cfg.train.compile}
    policy = get_model_spec(cfg.policy.family).build(cfg.policy).to(env.device)
    step = loongforge_step(policy, cfg.train, env.device, batch)
    report["loongforge_samples_per_s"] = samples_per_second(step, args.batch_size, args.steps, args.warmup, sync)
    del policy, step
    if args.against_lerobot:
        ref = build_lerobot_pi05_released(cfg.policy, dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
        ref = ref.to(env.device)
        report["lerobot_samples_per_s"] = samples_per_second(lerobot_step(ref, batch), args.batch_size, args.steps, args.warmup, sync)
        report["speedup"] = report["loongforge_samples_per_s"] / report["lerobot_samples_per_s"]
    print(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lf-embodied", description="LoongForge embodied (VLA) policies", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("train", "info"):
        p = sub.add_parser(name, allow_abbrev=False)
        p.add_argument("--config", default="train", help="config name (shipped) or YAML path")
    p = sub.add_parser("bench", allow_abbrev=False)
    p.add_argument("--config", default="train")
    p.add_argument("--against-lerobot", action="store_true", help="also time LeRobot's PI05Pytorch (needs policy=pi05_base)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p = sub.add_parser("eval")
    p.add_argument("--checkpoint", required=True, help="a run directory or checkpoint directory")
    p = sub.add_parser("export")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--format", default="loongforge", choices=["loongforge", "lerobot"])
    p = sub.add_parser("convert")
    p.add_argument("--from-lerobot", required=True, help="a LeRobot pi05 model.safetensors")
    p.add_argument("--out", required=True)
    add_run_commands(sub)
    args, rest = parser.parse_known_args(argv)
    if args.command in ("export", "convert", "plot", "compare") and rest:
        parser.error(f"unexpected arguments: {rest}")
    if args.command in ("plot", "compare"):  # the run-directory commands every lf-* CLI shares
        return run_main(lambda: args.fn(args))
    commands = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "convert": cmd_convert, "info": cmd_info,
                "bench": cmd_bench}
    return run_main(lambda: commands[args.command](args, rest))


if __name__ == "__main__":
    sys.exit(main())
