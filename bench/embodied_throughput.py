"""VLA training-step throughput: LoongForge's Pi0.5 policy vs LeRobot's own ``PI05Pytorch``.

Run on a CUDA machine:  uv run python bench/embodied_throughput.py [KEY=VALUE ...] [--batch-size N]

Both policies are built at the released Pi0.5 size (PaliGemma 2B backbone, 300M action expert,
SigLIP-So400m, 224x224 cameras) and train on the same synthetic batch in this process
(``lf-embodied bench --against-lerobot``): forward, backward and AdamW, timed after warm-up.
Ours runs in bf16 with compiled blocks; LeRobot's in its own bf16 mode. The printed ``speedup``
is our samples/s over LeRobot's. Extra arguments override the defaults (later wins).
"""

from __future__ import annotations

import sys

from loongforge.embodied.cli import main

DEFAULT = ["bench", "--against-lerobot", "--batch-size", "8", "--steps", "10",
           "policy=pi05_base", "train.precision=bf16", "train.compile=true"]

if __name__ == "__main__":
    sys.exit(main(DEFAULT + sys.argv[1:]))
