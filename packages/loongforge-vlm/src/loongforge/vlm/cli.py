"""``lf-vlm``: train, inspect and convert vision-language models on megatron-core.

    lf-vlm train [--config NAME_OR_PATH] [key=value ...]
    lf-vlm info [--config NAME_OR_PATH] [key=value ...]
    lf-vlm convert hf-to-lf HF_DIR OUT [--dtype bf16|fp16|fp32] | lf-to-hf CHECKPOINT OUT
    lf-vlm bench [--tiny] [--samples N] [--image-size PX] [--variant NAME=K=V,...]  (vs transformers' Qwen2.5-VL)
    lf-vlm plot RUN_DIR | compare RUN_A RUN_B

Group overrides swap a part: ``lf-vlm train foundation=llama_debug``, ``encoder=siglip_vit_debug
projector=mlp_2x``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loongforge.core.cli import add_config_arguments, add_run_commands, normalise_overrides, run_main

DEFAULT_CONFIG = "vlm_debug"
TRAIN_CONFIG = "train.yaml"


def config_dirs() -> list[Path]:
    """The VLM's configs, and loongforge-llm's (the ``foundation`` group reuses its model configs)."""
    from loongforge.llm.recipe import CONFIG_DIR as LLM_CONFIG_DIR
    from loongforge.vlm.recipe import CONFIG_DIR

    return [CONFIG_DIR, LLM_CONFIG_DIR]


def load_vlm_config(name: str | None, overrides: list[str]):
    from loongforge.core.config import load_config
    from loongforge.vlm.recipe import VLMConfig

    return load_config(VLMConfig, name, normalise_overrides(overrides), config_dirs())


def cmd_train(args) -> int:
    cfg = load_vlm_config(args.config, args.overrides)  # fails here, before any process group, on a bad config
    from loongforge.core.training.run import run_training
    from loongforge.vlm.recipe import VLMTask

    run_training(cfg, VLMTask(cfg), "lf-vlm")  # the task checks the tokenizer before any process group too
    return 0


def cmd_info(args) -> int:
    cfg = load_vlm_config(args.config, args.overrides)
    f = cfg.foundation
    counts = cfg.model().parameter_counts()
    print(json.dumps({
        "encoder": cfg.encoder.kind, "projector": cfg.projector.kind, "foundation": f.family,
        "parameters": counts, "total_parameters": sum(counts.values()),
        "foundation_flops_per_token": f.flops_per_token(cfg.train.seq_length),
        "encoder_flops_per_patch": cfg.encoder.flops_per_patch(),
        "mrope_section": cfg.model().mrope_section, "trainable": cfg.trainable,
    }, indent=1))
    return 0


def write_train_config(converted, root: Path) -> Path:
    """``ROOT/train.yaml``: train from the converted weights (the parts are the converted config)."""
    from omegaconf import OmegaConf

    from loongforge.core.config import to_dict

    model = to_dict(converted.model_config)
    doc = {**model, "train": {"seq_length": 2048, "lr": 1.0e-5, "min_lr": 1.0e-6},
           "checkpoint": {"load": str(root.resolve())}, "log": {"run_dir": "runs/vlm-from-hf"}}
    if converted.tokenizer is not None and (converted.tokenizer / "tokenizer.json").is_file():
        doc["data"] = {"tokenizer": str(converted.tokenizer)}
    path = root / TRAIN_CONFIG
    header = (f"# Train from the weights converted into {root.resolve()}:\n"
              f"#   lf-vlm train --config {path.resolve()} data.path=CONVERSATIONS.jsonl [key=value ...]\n")
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(doc)))
    return path


def cmd_convert(args) -> int:
    import torch

    from loongforge.core.checkpoint import CheckpointReadError
    from loongforge.core.hf_mapping import MappingError
    from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(args.dtype)
    try:
        if args.direction == "hf-to-lf":
            done = hf_to_lf(args.source, args.out, dtype=dtype, progress=not args.no_progress)
            if done.family != "vlm":
                raise MappingError(f"{args.source}: a {done.family} model, not a VLM (use that family's CLI)")
            config = write_train_config(done, Path(args.out))
            print(f"lf-vlm: {done.tensors} tensors -> {done.path}; tokenizer {done.tokenizer or 'none found'}; "
                  f"train with: lf-vlm train --config {config}")
        else:
            done = lf_to_hf(args.source, args.out, dtype=dtype, progress=not args.no_progress)
            print(f"lf-vlm: {done.tensors} tensors -> {done.path}" + ("" if done.tokenizer else " (no tokenizer found)"))
    except (MappingError, CheckpointReadError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_bench(args) -> int:
    from loongforge.vlm.bench import run_bench

    run_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lf-vlm", description="LoongForge vision-language models on megatron-core")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (no arguments: the debug VLM on the shipped shapes set)")
    add_config_arguments(train, DEFAULT_CONFIG)
    train.set_defaults(fn=cmd_train)
    info = sub.add_parser("info", help="parts, parameter counts and FLOPs of a config")
    add_config_arguments(info, DEFAULT_CONFIG)
    info.set_defaults(fn=cmd_info)
    conv = sub.add_parser("convert", help="Qwen2.5-VL Hugging Face directories <-> LoongForge checkpoints")
    conv.add_argument("direction", choices=["hf-to-lf", "lf-to-hf"])
    conv.add_argument("source", help="HF model directory (hf-to-lf) or LoongForge checkpoint (lf-to-hf)")
    conv.add_argument("out", help="output directory (must not exist)")
    conv.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point weights (default: keep)")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.set_defaults(fn=cmd_convert)
    bench = sub.add_parser("bench", help="time our training step against transformers' Qwen2.5-VL (one process)")
    from loongforge.vlm.bench import add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(fn=cmd_bench)
    add_run_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from loongforge.llm.data.errors import DataError

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)

    def body():
        try:
            return args.fn(args)
        except DataError as exc:  # a data file, record or tokenizer that cannot be used: one clear line
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run_main(body)


if __name__ == "__main__":
    sys.exit(main())
