"""``lf-llm lora``: export a LoRA training checkpoint.

    lf-llm lora merge CKPT OUT           # OUT/step_00000000: the base weights with W + (alpha/r) B A
    lf-llm lora export-adapter CKPT OUT  # OUT/step_00000000: the adapter tensors alone

A merged checkpoint is a plain checkpoint of the family: ``lf-llm convert lf-to-hf OUT HF_DIR``
exports it to Hugging Face, ``checkpoint.load=OUT`` trains on from it.
"""

from __future__ import annotations

import sys


def cmd_lora(args) -> int:
    from loongforge.core.checkpoint import CheckpointReadError
    from loongforge.llm.lora import adapter_checkpoint, merge_checkpoint

    export = merge_checkpoint if args.action == "merge" else adapter_checkpoint
    try:
        path = export(args.checkpoint, args.out)
    except (CheckpointReadError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = "merged weights" if args.action == "merge" else "adapters"
    print(f"lf-llm: {what} of {args.checkpoint} -> {path}")
    return 0


def add_lora_command(sub) -> None:
    lora = sub.add_parser("lora", help="export a LoRA checkpoint: merged into the base weights, or the adapters alone")
    lora.add_argument("action", choices=["merge", "export-adapter"])
    lora.add_argument("checkpoint", help="LoRA training checkpoint (a step directory or a checkpoint root)")
    lora.add_argument("out", help="output checkpoint root (must not hold a step_00000000 yet)")
    lora.set_defaults(fn=cmd_lora)
