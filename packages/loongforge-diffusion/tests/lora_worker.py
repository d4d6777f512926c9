"""Run by test_lora.py under `torchrun --nproc-per-node 2`: a LoRA run on DP=2 with FSDP2 (the
pretrained weights read shard by shard into a meta-built model, the adapters initialised after
sharding, packed micro-batches), stopped after 2 steps and resumed.

Usage: lora_worker.py OUT_DIR OVERRIDE...
"""

import sys

from loongforge.core.config import load_config
from loongforge.core.distributed import init_distributed
from loongforge.core.training.run import run_training
from loongforge.diffusion.cli import CONFIG_DIR, DEFAULT_TRAIN
from loongforge.diffusion.schema import DiffusionRecipe
from loongforge.diffusion.task import FlowMatchingTask

out, common = sys.argv[1], sys.argv[2:]


def run(name: str, *extra: str) -> None:
    recipe = load_config(DiffusionRecipe, DEFAULT_TRAIN, [f"log.run_dir={out}/{name}", *extra, *common], [CONFIG_DIR])
    run_training(recipe, FlowMatchingTask(recipe), "worker")


init_distributed(group_for_world_of_one=True)  # one group for both runs
fsdp = ("parallel.data_parallel=fsdp", "balance.token_cap=20")
run("lora_fsdp2", *fsdp, "train.exit_interval=2")
run("lora_fsdp2", *fsdp)
