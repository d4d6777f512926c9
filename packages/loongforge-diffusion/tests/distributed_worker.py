"""Run by test_distributed.py under `torchrun --nproc-per-node 2`, in one process group:

- ``cp2``: Ulysses CP=2 (DDP over the two CP ranks), straight through;
- ``dp2_fsdp2``: DP=2 on FSDP2 with packed micro-batches (uneven counts per rank), the pretrained
  weights loaded shard by shard onto a meta-initialised model, stopped after 2 steps and resumed.

Usage: distributed_worker.py OUT_DIR OVERRIDE...
"""

import sys

from loongforge.core.config import load_config
from loongforge.core.distributed import init_distributed
from loongforge.core.training.run import run_training
from loongforge.diffusion.cli import CONFIG_DIR, DEFAULT_TRAIN
from loongforge.diffusion.schema import DiffusionRecipe
from loongforge.diffusion.task import WanTask

out, common = sys.argv[1], sys.argv[2:]


def run(name: str, *extra: str) -> None:
    recipe = load_config(DiffusionRecipe, DEFAULT_TRAIN, [f"log.run_dir={out}/{name}", *extra, *common], [CONFIG_DIR])
    run_training(recipe, WanTask(recipe), "worker")


init_distributed(group_for_world_of_one=True)  # one group for the three runs (run_training keeps it)
run("cp2", "parallel.cp=2")
fsdp = ("parallel.data_parallel=fsdp", "balance.token_cap=20")
run("dp2_fsdp2", *fsdp, "train.exit_interval=2")
run("dp2_fsdp2", *fsdp)
