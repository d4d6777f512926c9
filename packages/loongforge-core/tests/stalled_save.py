"""Saves checkpoint 1, then starts checkpoint 2 and stalls half-way through writing it, for
test_checkpoint_safety.py to SIGKILL: ``python stalled_save.py ROOT MARKER``.

The stall is deterministic: checkpoint 2's per-rank objects hold a value whose pickling touches
MARKER and then sleeps, so when MARKER appears the shard file is written, the objects file is
open and partly written, and nothing has been committed.
"""

import sys
import time
from pathlib import Path

import torch

from loongforge.core.checkpoint import save_checkpoint


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


class Stall:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        self.marker.touch()
        time.sleep(600)
        raise RuntimeError("not killed")


if __name__ == "__main__":
    root, marker = Path(sys.argv[1]), Path(sys.argv[2])
    save_checkpoint(root, 1, tensors(1), objects={"note": "first"})
    save_checkpoint(root, 2, tensors(2), objects={"stall": Stall(marker)})
