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

HERE = Path(__file__).resolve().parent  # core_helpers.py
ENV = {"PATH": "/usr/bin:/bin", "LOONGFORGE_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

TRAIN = textwrap.dedent("""
    import sys

    import torch

    sys.path.insert(0, sys.argv[2])  # core_helpers

    from core_helpers import RunConfig, ToyTask
    from loongforge.core.parallel import MeshGroups
    from loongforge.core.training.run import run_training
    from loongforge.core.training.schema import LogConfig, TrainConfig


    class MeshToyTask(ToyTask):
        def build_model(self, ctx):
            assert isinstance(ctx.pgs, MeshGroups) and ctx.pgs.mesh.mesh_dim_names == ("dp", "cp"), ctx.pgs
            return super().build_model(ctx)


    def batches(ctx, step):
        g = torch.Generator().manual_seed(ctx.dp_rank)  # the same batch each step: the loss falls
        return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))]


    run_dir = sys.argv[1]
    cfg = RunConfig(train=TrainConfig(steps=3, global_batch_size=2, lr=1e-2, warmup_steps=0, compile=False),
                    log=LogConfig(run_dir=run_dir, progress=False, tensorboard=False))
    run_training(cfg, MeshToyTask(batches=batches), "toy")
    megatron = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
    assert not megatron, megatron[:5]
    print("ok")
""")


def test_a_torch_engine_run_imports_no_megatron(tmp_path):
    script = tmp_path / "train_toy.py"
    script.write_text(TRAIN)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(run_dir), str(HERE)], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("ok") == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["loss"] < records[0]["loss"]
    assert (Path(run_dir) / "checkpoints" / "latest").is_file()
