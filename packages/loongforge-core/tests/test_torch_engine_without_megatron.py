"""A run on the PyTorch-native engine needs no megatron-core: ``run_training`` of a small
``TorchTask`` (two data-parallel ranks on gloo, a torch ``DeviceMesh``) trains and saves without
importing megatron or installing the cpu accelerator's megatron-core adaptations, and its groups
are the mesh's (``MeshGroups``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ENV = {"PATH": "/usr/bin:/bin", "LOONGFORGE_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

TRAIN = textwrap.dedent("""
    import json
    import sys
    from dataclasses import dataclass, field

    import torch
    import torch.nn as nn

    from loongforge.core.parallel import MeshGroups
    from loongforge.core.training.run import run_training
    from loongforge.core.training.schema import CheckpointConfig, LogConfig, ParallelConfig, TrainConfig
    from loongforge.core.training.task import StepBatch, TorchTask
    from loongforge.core.training.torch_model import TorchModel


    class Toy(TorchModel):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.head = nn.Linear(8, 1)

        def repeated_blocks(self):
            return list(self.blocks)

        def forward(self, x):
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)


    class ToyTask(TorchTask):
        family = "toy"

        def model_config_dict(self):
            return {"width": 8}

        def build_model(self, ctx):
            assert isinstance(ctx.pgs, MeshGroups) and ctx.pgs.mesh.mesh_dim_names == ("dp", "cp"), ctx.pgs
            return Toy()

        def steps(self, ctx, start_step):
            step = start_step
            while True:
                g = torch.Generator().manual_seed(ctx.dp_rank)  # the same batch each step: the loss falls
                yield StepBatch(micro_batches=[(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))])
                step += 1

        def forward(self, model, batch):
            x, y = batch
            return model(x), lambda out: ((out - y).pow(2).sum(), y.numel())


    @dataclass
    class RunConfig:
        train: TrainConfig
        log: LogConfig
        checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
        parallel: ParallelConfig = field(default_factory=ParallelConfig)


    run_dir = sys.argv[1]
    cfg = RunConfig(train=TrainConfig(steps=3, global_batch_size=2, lr=1e-2, warmup_steps=0, compile=False),
                    log=LogConfig(run_dir=run_dir, progress=False, tensorboard=False))
    run_training(cfg, ToyTask(), "toy")
    megatron = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
    assert not megatron, megatron[:5]
    print("ok")
""")


def test_a_torch_engine_run_imports_no_megatron(tmp_path):
    script = tmp_path / "train_toy.py"
    script.write_text(TRAIN)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(run_dir)], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("ok") == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] < records[0]["loss"]
    assert (Path(run_dir) / "checkpoints" / "latest").is_file()
