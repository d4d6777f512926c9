"""Diffusion training-step throughput: LoongForge's Wan DiT step vs diffusers' Wan training step.

Run on a CUDA machine:  uv run python bench/diffusion_throughput.py [--steps N] [--rounds R] [--processes P] [KEY=VALUE ...]

The default case is a Wan2.1-T2V-1.3B-shaped model cut to 4 layers on 480x832 video of 33 frames
(one latent of 16 x 9 x 60 x 104, 14040 tokens), bf16 autocast. Both steps run in this process on
the same weights and latents (``lf-diffusion bench``, whose docstring says what runs): diffusers
as its docs recommend for GPU training (``compile_repeated_blocks()``, fused AdamW, TF32, SDPA,
its gradient checkpointing) against ours with the same checkpointing (``train.recompute=full``) in
the headline row, then ours with the preset's selective recomputation, in alternating rounds;
the bench prints the baseline's settings and checks the first-step losses. Then ours runs again
with FP8 linears (``model.fp8=tensorwise``), with no recomputation, and uncompiled (last: its
host-bound step is the slowest). Extra arguments override the defaults (later wins;
``--variant NAME=KEY=VALUE,...`` adds a variant, ``--profile-rows 0`` skips the diagnostics).
"""

from __future__ import annotations

import sys

from loongforge.diffusion.cli import main

OPTIONS = ["--config", "wan2_1_t2v_1_3b", "--steps", "10",
           "--variant", "fp8=model.fp8=tensorwise",
           "--variant", "recompute_none=train.recompute=none",
           "--variant", "eager=train.compile=false"]
OVERRIDES = ["model.num_layers=4", "sample.num_frames=33", "sample.height=480", "sample.width=832"]
FLAGS = ()  # options without a value


def arguments(user: list[str]) -> list[str]:
    """The bench command line: the defaults with the user's options and overrides after them
    (options before overrides, as the parser wants them)."""
    options, overrides, i = [], [], 0
    while i < len(user):
        item = user[i]
        if item.startswith("--"):
            takes_value = item not in FLAGS and "=" not in item
            options += user[i : i + 2] if takes_value else [item]
            i += 2 if takes_value else 1
        else:
            overrides.append(item)
            i += 1
    return ["bench", *OPTIONS, *options, *OVERRIDES, *overrides]


if __name__ == "__main__":
    sys.exit(main(arguments(sys.argv[1:])))
