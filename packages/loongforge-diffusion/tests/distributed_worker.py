"""Run by test_distributed.py under `torchrun --nproc-per-node 2`: the same short training as the
single-process reference, once with Ulysses CP=2 (DDP over the CP ranks) and once with DP=2 on
FSDP2 with micro-batch packing, in one process group. Usage: distributed_worker.py OUT_DIR OVERRIDE..."""

import sys

from loongforge.core.config import load_config
from loongforge.diffusion.cli import CONFIG_DIR, DEFAULT_TRAIN
from loongforge.diffusion.schema import DiffusionRecipe
from loongforge.diffusion.trainer import DiffusionTrainer

out, common = sys.argv[1], sys.argv[2:]
for name, extra in (("cp2", ["parallel.cp=2"]),
                    ("dp2_fsdp2", ["train.data_parallel=fsdp2", "data.max_tokens_per_pack=20"])):
    recipe = load_config(DiffusionRecipe, DEFAULT_TRAIN, [f"log.run_dir={out}/{name}", *extra, *common], [CONFIG_DIR])
    DiffusionTrainer(recipe).fit()
