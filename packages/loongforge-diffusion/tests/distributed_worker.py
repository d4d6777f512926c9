"""Run by test_distributed.py under `torchrun --nproc-per-node 2`, in one process group:

- ``cp2``: Ulysses CP=2 (DDP over the two CP ranks), straight through;
- ``dp2_fsdp2``: DP=2 on FSDP2 with packed micro-batches (uneven counts per rank), the pretrained
  weights loaded shard by shard onto a meta-initialised model, stopped after 2 steps and resumed.

With ``--cp2-config=NAME`` (repeatable) it runs only ``cp2_NAME``: config NAME on CP=2.

Usage: distributed_worker.py OUT_DIR [--cp2-config=NAME ...] OVERRIDE...
"""

import sys

from loongforge.core.config import load_config
from loongforge.core.distributed import init_distributed
from loongforge.core.training.run import run_training
from loongforge.diffusion.cli import CONFIG_DIR, DEFAULT_TRAIN
from loongforge.diffusion.schema import DiffusionRecipe
from loongforge.diffusion.task import FlowMatchingTask

FLAG = "--cp2-config="
out = sys.argv[1]
configs = [a.removeprefix(FLAG) for a in sys.argv[2:] if a.startswith(FLAG)]
common = [a for a in sys.argv[2:] if not a.startswith(FLAG)]


def run(name: str, *extra: str, config: str = DEFAULT_TRAIN) -> None:
    recipe = load_config(DiffusionRecipe, config, [f"log.run_dir={out}/{name}", *extra, *common], [CONFIG_DIR])
    run_training(recipe, FlowMatchingTask(recipe), "worker")


init_distributed(group_for_world_of_one=True)  # one group for all runs (run_training keeps it)
if configs:
    for config in configs:
        run(f"cp2_{config}", "parallel.cp=2", config=config)
else:
    run("cp2", "parallel.cp=2")
    fsdp = ("parallel.data_parallel=fsdp", "balance.token_cap=20")
    run("dp2_fsdp2", *fsdp, "train.exit_interval=2")
    run("dp2_fsdp2", *fsdp)
