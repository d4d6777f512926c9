"""``lf-llm convert``: Hugging Face model directories <-> LoongForge checkpoints.

    lf-llm convert hf-to-lf HF_DIR OUT   # OUT/step_00000000 + OUT/latest + OUT/train.yaml
    lf-llm convert lf-to-hf CKPT OUT     # CKPT: a step directory or a checkpoint root

``hf-to-lf`` also writes ``OUT/train.yaml``, a config that trains from the converted weights
(the model section is the converted config, ``checkpoint.load`` points at ``OUT``):
``lf-llm train --config OUT/train.yaml [key=value ...]``. The family comes from
``config.json``'s ``architectures``; the conversion itself is the core's streaming converter
driven by the family's mapping table.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TRAIN_CONFIG = "train.yaml"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 500MB or 2GB")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def write_train_config(converted, root: Path) -> Path:
    """``ROOT/train.yaml``: train from the converted weights with every other setting default."""
    from omegaconf import OmegaConf

    doc = {"model": converted.model_config.architecture(), "checkpoint": {"load": str(root.resolve())},
           "log": {"run_dir": f"runs/{converted.family}-from-hf"}}
    if converted.tokenizer is not None and (converted.tokenizer / "tokenizer.json").is_file():
        doc["data"] = {"tokenizer": str(converted.tokenizer)}
    path = root / TRAIN_CONFIG
    header = (f"# Train from the weights converted into {root.resolve()}:\n"
              f"#   lf-llm train --config {path.resolve()} [key=value ...]\n")
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(doc)))
    return path


def cmd_convert(args) -> int:
    from loongforge.core.checkpoint import CheckpointReadError
    from loongforge.core.hf_mapping import MappingError
    from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf

    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        if args.direction == "hf-to-lf":
            done = hf_to_lf(args.source, args.out, dtype=dtype, progress=not args.no_progress, max_shard_bytes=args.shard_size)
            config = write_train_config(done, Path(args.out))
            print(f"lf-llm: {done.family} ({done.tensors} tensors) -> {done.path}; "
                  f"tokenizer {done.tokenizer or 'none found'}; train with: lf-llm train --config {config}")
        else:
            done = lf_to_hf(args.source, args.out, dtype=dtype, progress=not args.no_progress, max_shard_bytes=args.shard_size)
            print(f"lf-llm: {done.family} ({done.tensors} tensors) -> {done.path}"
                  + ("" if done.tokenizer else " (no tokenizer found to copy)"))
    except (MappingError, CheckpointReadError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_convert_command(sub) -> None:
    conv = sub.add_parser("convert", help="convert between Hugging Face model directories and LoongForge checkpoints")
    conv.add_argument("direction", choices=["hf-to-lf", "lf-to-hf"])
    conv.add_argument("source", help="HF model directory (hf-to-lf) or LoongForge checkpoint (lf-to-hf)")
    conv.add_argument("out", help="output directory (must not exist)")
    conv.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point weights (default: keep)")
    conv.add_argument("--shard-size", type=parse_size, default=parse_size("2GB"), help="max bytes per output file (default 2GB)")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.set_defaults(fn=cmd_convert)
