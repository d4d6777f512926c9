"""``lf-llm``: train, preprocess, info, bench, convert, lora, plot and compare for LLMs on megatron-core.

    lf-llm train [--config NAME_OR_PATH] [--save-hf OUT] [key=value ...]   (model.init_from_hf=HF_DIR: start from HF)
    lf-llm preprocess --input F [F ...] --output-prefix P [--tokenizer DIR] [--json-key text]
    lf-llm info [--config NAME_OR_PATH] [--dp N] [key=value ...]
    lf-llm convert hf-to-lf HF_DIR OUT [--dtype bf16|fp16|fp32] | lf-to-hf CHECKPOINT OUT
    lf-llm convert lora-to-peft CHECKPOINT OUT   (a LoRA run's adapters in PEFT's format, transformers names)
    lf-llm lora merge CHECKPOINT OUT
    lf-llm bench [--config train_0_5b] [--steps N] [--fp8 MODE] [--variant NAME=K=V,...] [key=value ...]
    lf-llm plot RUN_DIR | compare RUN_A RUN_B [--window N] [--tolerance F]
"""

from __future__ import annotations

import json
import sys

from loongforge.core.config import ConfigError
from loongforge.llm.shipped_configs import CONFIG_DIR


def load_config(name_or_path: str | None, overrides: list[str]):
    from loongforge.llm.recipe import load_llm_config

    return load_llm_config(name_or_path, overrides)


def cmd_info(args, cfg) -> None:
    from loongforge.core.parallel import ParallelLayout
    from loongforge.llm.sizing import size_report

    m, p = cfg.model, cfg.parallel
    layout = ParallelLayout(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep)
    precision = "fp32" if cfg.train.precision == "fp32" else "bf16"  # "auto" is bf16 on GPUs
    try:
        sizes = size_report(m, layout, args.dp, precision=precision, distributed_optimizer=cfg.train.use_distributed_optimizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    report = {"family": m.family, "parameters": m.parameter_counts(), **sizes,
              "flops_per_token": m.flops_per_token(cfg.train.seq_length)}
    if args.activations:
        from loongforge.llm import activation_memory

        dp = sizes["layout"]["dp"]
        mbs = cfg.train.micro_batch_size or max(1, cfg.train.global_batch_size // dp)
        num_microbatches = max(1, cfg.train.global_batch_size // (mbs * dp))
        profile = activation_memory.measure(cfg)
        report["activations"] = activation_memory.per_gpu(profile, cfg, layout, mbs, num_microbatches)
    print(json.dumps(report, indent=1))


def cmd_preprocess(args) -> int:
    from loongforge.llm.data.preprocess import preprocess_from_args

    preprocess_from_args(args)  # prints what it wrote
    return 0


def make_task(cfg):
    """The task of the config's model family (``ModelSpec.task``: pre-training or SFT by ``recipe``)."""
    from loongforge.core.models import get_model_spec

    return get_model_spec(cfg.model.family).make_task(cfg)


def info_options(parser) -> None:
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel size to size the layout for (default: the smallest parallel.ep allows)")
    parser.add_argument("--no-activations", dest="activations", action="store_false",
                        help="skip the activation memory (measured on a one-layer proxy of the model on the CPU)")


def bench_options(parser) -> None:
    from loongforge.llm.bench import BASELINES

    parser.add_argument("--fp8", action="append", default=[], choices=["blockwise", "adaptive"],
                        help="one more run of ours with fp8=<mode>, compared with ours in bf16")
    parser.add_argument("--skip", action="append", default=[], choices=list(BASELINES),
                        help="a baseline to leave out")


def bench(args, config: str, overrides: list[str]) -> None:
    from loongforge.core.bench_protocol import repeat_in_processes
    from loongforge.llm.bench import BASELINES, run_bench, step_seconds

    options = dict(config=config, overrides=list(overrides), steps=args.steps, warmup=args.warmup, variants=args.variant,
                   fp8=args.fp8, skip=args.skip, rounds=args.rounds)
    if args.processes > 1:
        return repeat_in_processes(step_seconds, dict(options, profile_rows=0), args.processes, BASELINES)
    run_bench(**options, profile_rows=args.profile_rows, trace=args.trace)


def commands(sub) -> None:
    pre = sub.add_parser("preprocess", help="tokenize text/JSONL into a megatron indexed dataset (.bin/.idx)")
    from loongforge.llm.data.preprocess import add_preprocess_arguments

    add_preprocess_arguments(pre)
    pre.set_defaults(fn=cmd_preprocess)
    from loongforge.llm.lora_command import add_lora_command

    add_lora_command(sub)


def describe_cli():
    """This package's ``ModalityCLI`` (``loongforge.core.cli``)."""
    from loongforge.core.cli import ModalityCLI
    from loongforge.llm.convert import convert_options, converters
    from loongforge.llm.lora_command import lora_layouts

    return ModalityCLI(
        prog="lf-llm", module="loongforge.llm.cli", description="LoongForge LLM training on megatron-core",
        config_dirs=[CONFIG_DIR], default_config="train_debug", load_config=load_config,
        make_task=make_task, info=cmd_info, info_options=info_options, example="train.steps=200 parallel.tp=2",
        converters=converters("lf-llm"), convert_options=convert_options,
        lora_layouts=lora_layouts, lora_library="transformers",
        bench_options=bench_options, bench=bench, default_bench_config="train_0_5b",
        commands=commands, packages=["loongforge-core", "loongforge-llm", "loongforge-kernels"],
    )


def main(argv: list[str] | None = None) -> int:
    from loongforge.core.cli import build_cli

    return build_cli(describe_cli)(argv)


if __name__ == "__main__":
    sys.exit(main())
