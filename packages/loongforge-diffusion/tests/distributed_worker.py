"""Run by test_distributed.py under `torchrun --nproc-per-node 2`, in one process group:

- ``cp2``: Ulysses CP=2 (DDP over the two CP ranks), straight through;
- ``dp2_fsdp2``: DP=2 on FSDP2 with packed micro-batches (uneven counts per rank), the pretrained
  weights loaded shard by shard onto a meta-initialised model, stopped after 2 steps and resumed.

With ``--cp2-config=NAME`` (repeatable) it runs only ``cp2_NAME``: config NAME on CP=2; with
``--dp2-config=NAME`` only ``ddp2_NAME`` and ``fsdp2_NAME``: config NAME on DP=2, DDP and FSDP2.

Usage: distributed_worker.py OUT_DIR [--cp2-config=NAME ... | --dp2-config=NAME] OVERRIDE...
"""

import sys

from loongforge.core.distributed import init_distributed
from loongforge.core.training.run import run_training
from loongforge.diffusion.cli import DEFAULT_TRAIN, load_recipe
from loongforge.diffusion.task import FlowMatchingTask

FLAG, DP_FLAG = "--cp2-config=", "--dp2-config="
out = sys.argv[1]
configs = [a.removeprefix(FLAG) for a in sys.argv[2:] if a.startswith(FLAG)]
dp_configs = [a.removeprefix(DP_FLAG) for a in sys.argv[2:] if a.startswith(DP_FLAG)]
common = [a for a in sys.argv[2:] if not a.startswith((FLAG, DP_FLAG))]


def run(name: str, *extra: str, config: str = DEFAULT_TRAIN) -> None:
    recipe = load_recipe(config, [f"log.run_dir={out}/{name}", *extra, *common])
    run_training(recipe, FlowMatchingTask(recipe), "worker")


init_distributed(group_for_world_of_one=True)  # one group for all runs (run_training keeps it)
if configs:
    for config in configs:
        run(f"cp2_{config}", "parallel.cp=2", config=config)
elif dp_configs:
    for config in dp_configs:
        run(f"ddp2_{config}", "parallel.data_parallel=ddp", config=config)
        run(f"fsdp2_{config}", "parallel.data_parallel=fsdp", config=config)
else:
    run("cp2", "parallel.cp=2")
    fsdp = ("parallel.data_parallel=fsdp", "balance.token_cap=20")
    run("dp2_fsdp2", *fsdp, "train.exit_interval=2")
    run("dp2_fsdp2", *fsdp)
