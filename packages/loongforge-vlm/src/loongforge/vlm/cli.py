"""``lf-vlm``: train, inspect and convert vision-language models on megatron-core.

    lf-vlm train [--config NAME_OR_PATH] [key=value ...]
    lf-vlm info [--config NAME_OR_PATH] [key=value ...]
    lf-vlm convert hf-to-lf HF_DIR OUT [--dtype bf16|fp16|fp32] | lf-to-hf CHECKPOINT OUT (LoRA: merged)
    lf-vlm convert lora-to-peft CHECKPOINT OUT   (a LoRA run's adapters in PEFT's format, transformers names)
    lf-vlm bench [--tiny] [--samples N] [--image-size PX] [--variant NAME=K=V,...]  (vs transformers' Qwen2.5-VL)
    lf-vlm plot RUN_DIR | compare RUN_A RUN_B

Group overrides swap a part: ``lf-vlm train foundation=llama_debug``, ``encoder=siglip_vit_debug
projector=mlp_2x``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loongforge.core.cli import convert_dtype
from loongforge.vlm.run_config import config_dirs, load_vlm_config, make_task

DEFAULT_CONFIG = "vlm_debug"
TRAIN_CONFIG = "train.yaml"


def cmd_info(args, cfg) -> None:
    f = cfg.foundation
    counts = cfg.model().parameter_counts()
    print(json.dumps({
        "encoder": cfg.encoder.family, "projector": cfg.projector.family, "foundation": f.family,
        "parameters": counts, "total_parameters": sum(counts.values()),
        "foundation_flops_per_token": f.flops_per_token(cfg.train.seq_length),
        "encoder_flops_per_patch": cfg.encoder.flops_per_patch(),
        "mrope_section": cfg.model().mrope_section, "trainable": cfg.trainable,
    }, indent=1))


def write_train_config(converted, root: Path) -> Path:
    """``ROOT/train.yaml``: train from the converted weights (the parts are the converted config)."""
    from omegaconf import OmegaConf

    from loongforge.core.config import to_dict

    model = to_dict(converted.model_config)
    doc = {**model, "train": {"seq_length": 2048, "lr": 1.0e-5, "min_lr_ratio": 0.1},
           "checkpoint": {"load": str(root.resolve())}, "log": {"run_dir": "runs/vlm-from-hf"}}
    from loongforge.vlm.hf import train_data

    data = train_data(converted.model_config)
    if converted.tokenizer is not None and (converted.tokenizer / "tokenizer.json").is_file():
        data["tokenizer"] = str(converted.tokenizer)
    if data:
        doc["data"] = data
    path = root / TRAIN_CONFIG
    header = (f"# Train from the weights converted into {root.resolve()}:\n"
              f"#   lf-vlm train --config {path.resolve()} data.path=CONVERSATIONS.jsonl [key=value ...]\n")
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(doc)))
    return path


def hf_to_lf_command(source: str, out: str, args) -> str:
    from loongforge.core.hf_mapping import MappingError
    from loongforge.core.hf_mapping.convert import hf_to_lf
    from loongforge.vlm.hf_siglip import refuse_whole_conversion

    refuse_whole_conversion(source)
    done = hf_to_lf(source, out, dtype=convert_dtype(args.dtype), progress=not args.no_progress)
    if done.family != "vlm":
        raise MappingError(f"{source}: a {done.family} model, not a VLM (use that family's CLI)")
    config = write_train_config(done, Path(out))
    return (f"lf-vlm: {done.tensors} tensors -> {done.path}; tokenizer {done.tokenizer or 'none found'}; "
            f"train with: lf-vlm train --config {config}")


def lf_to_hf_command(source: str, out: str, args) -> str:
    from loongforge.core.hf_mapping.convert import lf_to_hf

    done = lf_to_hf(source, out, dtype=convert_dtype(args.dtype), progress=not args.no_progress, command="lf-vlm")
    return f"lf-vlm: {done.tensors} tensors -> {done.path}" + ("" if done.tokenizer else " (no tokenizer found)")


def bench(args, config: str, overrides: list[str]) -> None:
    from loongforge.core.bench_protocol import repeat_in_processes
    from loongforge.vlm.bench import BASELINES, run_bench, step_seconds_from_args

    if args.processes > 1:
        options = {k: v for k, v in vars(args).items() if k != "fn"} | {"processes": 1}
        return repeat_in_processes(step_seconds_from_args, dict(options=options, config=config, overrides=overrides),
                                   args.processes, BASELINES)
    run_bench(args, config, overrides)


def bench_options(parser) -> None:
    from loongforge.vlm.bench import add_bench_arguments

    add_bench_arguments(parser)


def lora_layouts(manifest: dict, names: list[str]):
    from loongforge.vlm.lora import lora_layouts as layouts

    return layouts(manifest, names)


def describe_cli():
    """This package's ``ModalityCLI`` (``loongforge.core.cli``)."""
    from loongforge.core.cli import Converter, ModalityCLI

    return ModalityCLI(
        prog="lf-vlm", module="loongforge.vlm.cli", description="LoongForge vision-language models on megatron-core",
        config_dirs=config_dirs()[:1], default_config=DEFAULT_CONFIG, load_config=load_vlm_config,
        make_task=make_task, info=cmd_info,
        example="foundation=qwen3_debug encoder=siglip_vit_debug parallel.tp=2 parallel.encoder.tp=1",
        converters=[Converter("hf-to-lf", "a Qwen2.5-VL or Qwen3-VL Hugging Face directory or hub id (owner/name) -> a "
                              "LoongForge checkpoint",
                              hf_to_lf_command),
                    Converter("lf-to-hf", "a LoongForge VLM checkpoint (a LoRA one merged) -> a Qwen2.5-VL or "
                              "Qwen3-VL Hugging Face directory (by its encoder)",
                              lf_to_hf_command)],
        bench_options=bench_options, bench=bench, lora_layouts=lora_layouts, lora_library="transformers",
        packages=["loongforge-core", "loongforge-llm", "loongforge-vlm", "loongforge-kernels"],
    )


def main(argv: list[str] | None = None) -> int:
    from loongforge.core.cli import build_cli

    return build_cli(describe_cli)(argv)


if __name__ == "__main__":
    sys.exit(main())
