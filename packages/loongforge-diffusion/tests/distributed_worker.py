"""Run by test_distributed.py under `torchrun --nproc-per-node 2`, in one process group:

- ``cp2``: Ulysses CP=2 (DDP over the two CP ranks), straight through;
- ``dp2_fsdp2``: DP=2 on FSDP2 with packed micro-batches (uneven counts per rank), the pretrained
  weights loaded shard by shard onto a meta-initialised model, stopped after 2 steps and resumed.

Usage: distributed_worker.py OUT_DIR OVERRIDE...
"""

import sys

from loongforge.core.config import load_config
from loongforge.diffusion.cli import CONFIG_DIR, DEFAULT_TRAIN
from loongforge.diffusion.schema import DiffusionRecipe
from loongforge.diffusion.trainer import DiffusionTrainer

out, common = sys.argv[1], sys.argv[2:]


def run(name: str, *extra: str) -> None:
    recipe = load_config(DiffusionRecipe, DEFAULT_TRAIN, [f"log.run_dir={out}/{name}", *extra, *common], [CONFIG_DIR])
    DiffusionTrainer(recipe).fit()


run("cp2", "parallel.cp=2")
fsdp = ("train.data_parallel=fsdp2", "data.max_tokens_per_pack=20")
run("dp2_fsdp2", *fsdp, "train.exit_interval=2")
run("dp2_fsdp2", *fsdp)
