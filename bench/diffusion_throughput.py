"""Diffusion training-step throughput: LoongForge's Wan DiT step vs a plain diffusers step.

Run on a CUDA machine:  uv run python bench/diffusion_throughput.py [KEY=VALUE ...] [--steps N]

The default case is a Wan2.1-T2V-1.3B-shaped model cut to 4 layers on 480x832 video of 33 frames
(one latent of 16 x 9 x 60 x 104), bf16 autocast. Both steps run in this process on the same
weights and latents (``lf-diffusion bench``); the printed ratio is the baseline's step time over
ours. Extra arguments override the defaults (later wins).
"""

from __future__ import annotations

import sys

from loongforge.diffusion.cli import main

DEFAULT = ["bench", "--config", "wan2_1_t2v_1_3b", "--steps", "10",
           "model.num_layers=4", "sample.num_frames=33", "sample.height=480", "sample.width=832"]

if __name__ == "__main__":
    sys.exit(main(DEFAULT + sys.argv[1:]))
