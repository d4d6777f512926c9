"""``lf-llm``: train, preprocess, info, bench, convert, lora, plot and compare for LLMs on megatron-core.

    lf-llm train [--config NAME_OR_PATH] [--save-hf OUT] [key=value ...]   (model.init_from_hf=HF_DIR: start from HF)
    lf-llm preprocess --input F [F ...] --output-prefix P [--tokenizer DIR] [--json-key text]
    lf-llm info [--config NAME_OR_PATH] [--dp N] [key=value ...]
    lf-llm convert hf-to-lf HF_DIR OUT [--dtype bf16|fp16|fp32] | lf-to-hf CHECKPOINT OUT
    lf-llm lora merge|export-adapter CHECKPOINT OUT
    lf-llm bench [--config train_0_5b] [--steps N] [--fp8 MODE] [--variant NAME=K=V,...] [key=value ...]
    lf-llm plot RUN_DIR | compare RUN_A RUN_B [--window N] [--tolerance F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loongforge.core.cli import add_config_arguments, add_run_commands, normalise_overrides, run_main
from loongforge.core.config import ConfigError
from loongforge.llm import recipe
from loongforge.llm.recipe import LLMConfig


def load_llm_config(args) -> LLMConfig:
    return recipe.load_llm_config(args.config, normalise_overrides(args.overrides))


def check_save_hf(cfg: LLMConfig, out: str | None) -> Path | None:
    """``--save-hf OUT``: the final checkpoint is exported there, so it must be saved, be a plain
    model (adapters are merged first: ``lf-llm lora merge``) and OUT must be new."""
    if out is None:
        return None
    path = Path(out).expanduser().resolve()
    if path.exists():
        raise ConfigError(f"--save-hf {out}: {path} exists; the export writes a new directory")
    if not cfg.checkpoint.save:
        raise ConfigError(f"--save-hf {out} exports the final checkpoint; it needs checkpoint.save=true")
    if cfg.lora.enabled:
        raise ConfigError(f"--save-hf {out}: a LoRA run's checkpoint holds adapters; merge them with `lf-llm lora merge "
                          f"CHECKPOINT MERGED` and export with `lf-llm convert lf-to-hf MERGED OUT`")
    return path


def cmd_train(args) -> int:
    cfg = load_llm_config(args)  # fails here, before any process group, on a bad config
    save_hf = check_save_hf(cfg, args.save_hf)
    from loongforge.core.training.run import run_training
    from loongforge.llm.recipe import make_task

    after = None
    if save_hf is not None:
        def after(trainer):
            export_hf(trainer.ctx, trainer.ckpt_dir, save_hf, progress=cfg.log.progress)
    run_training(cfg, make_task(cfg), "lf-llm", after=after)
    return 0


def export_hf(ctx, checkpoints: Path, out: Path, progress: bool) -> None:
    """Rank 0 writes the latest checkpoint in ``checkpoints`` to the HF directory ``out``, after
    every rank has finished saving."""
    import torch.distributed as dist

    from loongforge.core.hf_mapping.convert import lf_to_hf

    if dist.is_initialized():
        dist.barrier()
    if ctx.is_main:
        done = lf_to_hf(checkpoints, out, progress=progress)
        print(f"lf-llm: {done.family} ({done.tensors} tensors) -> {done.path}"
              + ("" if done.tokenizer else " (no tokenizer found to copy)"), flush=True)


def cmd_info(args) -> int:
    cfg = load_llm_config(args)
    from loongforge.core.parallel import ParallelLayout
    from loongforge.llm.sizing import size_report

    m, p = cfg.model, cfg.parallel
    layout = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep)
    precision = "fp32" if cfg.train.precision == "fp32" else "bf16"  # "auto" is bf16 on GPUs
    try:
        sizes = size_report(m, layout, args.dp, precision=precision, distributed_optimizer=cfg.train.use_distributed_optimizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    print(json.dumps({"family": m.family, "parameters": m.parameter_counts(), **sizes,
                      "flops_per_token": m.flops_per_token(cfg.train.seq_length)}, indent=1))
    return 0


def cmd_preprocess(args) -> int:
    from loongforge.llm.data.preprocess import preprocess_from_args

    preprocess_from_args(args)  # prints what it wrote
    return 0


def cmd_bench(args) -> int:
    from loongforge.llm.bench import run_bench

    run_bench(args.config, normalise_overrides(args.overrides), steps=args.steps, warmup=args.warmup,
              variants=args.variant, fp8=args.fp8, skip=args.skip, profile_rows=args.profile_rows, trace=args.trace)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lf-llm", description="LoongForge LLM training on megatron-core")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (no arguments: the debug model on the bundled corpus)")
    add_config_arguments(train, "train_debug")
    train.add_argument("--save-hf", metavar="OUT", default=None,
                       help="at the end, export the final checkpoint to OUT as a Hugging Face model directory")
    train.set_defaults(fn=cmd_train)
    info = sub.add_parser("info", help="parameter counts (meta-device build), per-GPU memory of the layout, FLOPs")
    add_config_arguments(info, "train_debug")
    info.add_argument("--dp", type=int, default=None,
                      help="data-parallel size to size the layout for (default: the smallest parallel.ep allows)")
    info.set_defaults(fn=cmd_info)
    bench = sub.add_parser("bench", help="time our training step against HF transformers' Llama (one process)")
    add_config_arguments(bench, "train_0_5b")
    bench.add_argument("--steps", type=int, default=10, help="timed steps per run (the median is reported)")
    bench.add_argument("--warmup", type=int, default=3)
    bench.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                       help="one more run of ours with these overrides (comma-separated)")
    bench.add_argument("--fp8", action="append", default=[], choices=["blockwise", "adaptive"],
                       help="one more run of ours with fp8=<mode>, compared with ours in bf16")
    bench.add_argument("--skip", action="append", default=[], choices=["hf_sdpa", "hf_sdpa_compile"],
                       help="a baseline to leave out")
    bench.add_argument("--profile-rows", type=int, default=25, help="rows of ours' profiler tables (CUDA); 0: none")
    bench.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps of ours here")
    bench.set_defaults(fn=cmd_bench)
    pre = sub.add_parser("preprocess", help="tokenize text/JSONL into a megatron indexed dataset (.bin/.idx)")
    from loongforge.llm.data.preprocess import add_preprocess_arguments

    add_preprocess_arguments(pre)
    pre.set_defaults(fn=cmd_preprocess)
    from loongforge.llm.convert import add_convert_command

    add_convert_command(sub)
    from loongforge.llm.lora_command import add_lora_command

    add_lora_command(sub)
    add_run_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_main(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
