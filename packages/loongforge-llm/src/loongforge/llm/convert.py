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
from pathlib import Path

from loongforge.core.cli import convert_dtype

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


def hf_to_lf_command(source: str, out: str, args) -> str:
    from loongforge.core.hf_mapping.convert import hf_to_lf

    done = hf_to_lf(source, out, dtype=convert_dtype(args.dtype), progress=not args.no_progress,
                    max_shard_bytes=args.shard_size)
    config = write_train_config(done, Path(out))
    return (f"lf-llm: {done.family} ({done.tensors} tensors) -> {done.path}; tokenizer {done.tokenizer or 'none found'}; "
            f"train with: lf-llm train --config {config}")


def lf_to_hf_command(source: str, out: str, args) -> str:
    from loongforge.core.hf_mapping.convert import lf_to_hf

    done = lf_to_hf(source, out, dtype=convert_dtype(args.dtype), progress=not args.no_progress,
                    max_shard_bytes=args.shard_size, command="lf-llm")
    return (f"lf-llm: {done.family} ({done.tensors} tensors) -> {done.path}"
            + ("" if done.tokenizer else " (no tokenizer found to copy)"))


def converters(prog: str = "lf-llm"):
    from loongforge.core.cli import Converter

    return [Converter("hf-to-lf", "a Hugging Face model directory or hub id (owner/name[@revision]) -> a LoongForge "
                      "checkpoint (+ OUT/train.yaml)",
                      hf_to_lf_command),
            Converter("lf-to-hf", "a LoongForge checkpoint (step directory or root; a LoRA one merged) -> a Hugging Face directory",
                      lf_to_hf_command)]


def convert_options(parser) -> None:
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("2GB"),
                        help="max bytes per output file (default 2GB)")
