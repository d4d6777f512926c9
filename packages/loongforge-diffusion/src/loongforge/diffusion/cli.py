"""``lf-diffusion``: preprocess, train, sample, convert, bench, info, plot, compare."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

from loongforge.core.cli import add_config_arguments, add_run_commands, normalise_overrides, run_main

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_TRAIN = "tiny"
DEFAULT_PREPROCESS = "preprocess"


def _recipe(config: str, overrides: list[str]):
    from loongforge.core.config import load_config
    from loongforge.diffusion.schema import DiffusionRecipe

    return load_config(DiffusionRecipe, config, normalise_overrides(overrides), config_dirs=[CONFIG_DIR])


def cmd_train(args) -> int:
    from loongforge.core.training.run import run_training
    from loongforge.diffusion.task import WanTask

    recipe = _recipe(args.config, args.overrides)  # fails here, before any process group, on a bad config
    recipe.model.check_device(get_device_type())
    run_training(recipe, WanTask(recipe), "lf-diffusion")
    return 0


def get_device_type() -> str:
    from loongforge.core.accelerators import get_accelerator

    return get_accelerator().device_type


def cmd_preprocess(args) -> int:
    from loongforge.core.config import load_config
    from loongforge.core.distributed import init_distributed
    from loongforge.diffusion.preprocess import PreprocessConfig, preprocess

    cfg = load_config(PreprocessConfig, args.config, normalise_overrides(args.overrides), config_dirs=[CONFIG_DIR])
    # under torchrun each rank encodes its shards on its own device; the job's group orders the
    # manifest after all of them (a bad config has failed above, before any group exists)
    owned = not dist.is_initialized()
    init_distributed(group_for_world_of_one=False)
    try:
        manifest = preprocess(cfg)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    if manifest is not None:
        print(f"wrote {manifest}")
    return 0


def _run_config(run_dir: Path) -> str:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (is {run_dir} a `lf-diffusion train` run directory?)")
    return str(path)


def cmd_sample(args) -> int:
    from loongforge.diffusion.sampling import sample_run

    run_dir = Path(args.run)
    recipe = _recipe(args.config or _run_config(run_dir), args.overrides)
    checkpoint = args.checkpoint or (Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run_dir / "checkpoints")
    for path in sample_run(recipe, checkpoint, args.out or run_dir / "samples"):
        print(f"wrote {path}")
    return 0


def cmd_convert(args) -> int:
    from loongforge.core.checkpoint import load_checkpoint
    from loongforge.diffusion.model.convert import export_diffusers

    run_dir = Path(args.run)
    recipe = _recipe(args.config or _run_config(run_dir), args.overrides)
    tensors, manifest, _ = load_checkpoint(args.checkpoint or run_dir / "checkpoints")
    prefix = "ema." if args.ema else "model."
    if args.ema and not manifest.get("ema"):
        raise ValueError(f"{args.checkpoint or run_dir}: the checkpoint has no EMA weights")
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if args.ema:  # experts without EMA (not trained) export their model weights
        for k, v in tensors.items():
            if k.startswith("model.") and k[len("model."):] not in state:
                state[k[len("model."):]] = v
    for path in export_diffusers(state, recipe.model, args.out):
        print(f"wrote {path}")
    return 0


def cmd_info(args) -> int:
    import torch

    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.config import to_yaml
    from loongforge.diffusion.model import WanExperts

    recipe = _recipe(args.config, args.overrides)
    with torch.device("meta"):
        model = WanExperts(recipe.model)
    per_expert = sum(p.numel() for p in model.expert(model.names[0]).parameters())
    print(to_yaml(recipe))
    print(f"experts: {', '.join(model.names)}; parameters per expert: {per_expert / 1e6:.2f}M")
    print(f"accelerator: {get_accelerator()!r}")
    print(f"shipped configs: {', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.yaml')))}")
    return 0


def cmd_bench(args) -> int:
    from loongforge.diffusion.bench import run_bench

    recipe = _recipe(args.config, args.overrides)
    variants = [v.split() for v in args.variant]
    run_bench(recipe, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, variants=variants,
              profile=not args.no_profile, report=lambda line: print(line, flush=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lf-diffusion", description="LoongForge Wan-style video diffusion")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (no arguments: a tiny model on the built-in moving-shapes set)")
    add_config_arguments(p, DEFAULT_TRAIN)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("preprocess", help="encode videos/images + captions to latent shards")
    add_config_arguments(p, DEFAULT_PREPROCESS)
    p.set_defaults(fn=cmd_preprocess)

    for name, fn, text in (("sample", cmd_sample, "generate frames from a checkpoint into a PNG grid and GIF"),
                           ("convert", cmd_convert, "export a checkpoint as diffusers WanTransformer3DModel directories")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--run", default="runs/diffusion-tiny", help="run directory of `lf-diffusion train`")
        p.add_argument("--config", default=None, help="config (default: RUN/config.yaml)")
        p.add_argument("--checkpoint", default=None, help="checkpoint dir or root (default: the run's latest)")
        p.add_argument("--out", default=None, required=name == "convert",
                       help="output directory" + (" (default: RUN/samples)" if name == "sample" else ""))
        if name == "convert":
            p.add_argument("--ema", action="store_true", help="export the EMA weights")
        p.add_argument("overrides", nargs="*", metavar="key=value")
        p.set_defaults(fn=fn)

    p = sub.add_parser("info", help="print the composed config, model size and accelerator")
    add_config_arguments(p, DEFAULT_TRAIN)
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("bench", help="our training step vs a plain diffusers training step, same config and weights")
    add_config_arguments(p, DEFAULT_TRAIN)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--variant", action="append", default=[], metavar="'KEY=VALUE ...'",
                   help="also time ours with these config overrides (repeatable), e.g. "
                        "'train.recompute=none'")
    p.add_argument("--no-profile", action="store_true", help="skip the CUDA profiler table and attention timings")
    p.set_defaults(fn=cmd_bench)

    add_run_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_main(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
