"""``train.precision`` on the PyTorch-native engine, in one process: ``bf16-pure`` keeps the weights,
gradients and AdamW state in bf16 (the EMA weights in fp32), ``bf16`` (mixed) fp32 weights under
bf16 autocast; a pure run that stops after a checkpoint resumes to the uninterrupted run's losses
and tensors bitwise, and a resume with the other recipe is refused naming the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn

import core_helpers
from core_helpers import ToyTask
from loongforge.core.checkpoint import Checkpoint, CheckpointReadError
from loongforge.core.training.ema import EmaConfig
from loongforge.core.training.schema import CheckpointConfig, LogConfig, TrainConfig
from loongforge.core.training.torch_model import TorchModel

STEPS = 4


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class ResidualToy(TorchModel):
    """Two residual GELU blocks (``core_helpers.Toy``'s shape, its linear blocks made MLPs)."""

    def __init__(self, width: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 1)

    def repeated_blocks(self):
        return list(self.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(ctx, step: int) -> list:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(2)]


@dataclass
class RunConfig(core_helpers.RunConfig):
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(interval=2, keep_last=4))
    ema: EmaConfig = field(default_factory=lambda: EmaConfig(decay=0.9))


def trainer(ctx, run_dir, precision: str, log_interval: int = 1, **train):
    from loongforge.core.training.loop import Trainer

    options = dict(steps=STEPS, global_batch_size=2, micro_batch_size=1, lr=1e-2, warmup_steps=1, compile=False, seed=3)
    cfg = RunConfig(train=TrainConfig(**{**options, **train}, precision=precision),
                    log=LogConfig(run_dir=str(run_dir), progress=False, tensorboard=False,
                                                          interval=log_interval))
    torch.manual_seed(cfg.train.seed)
    return Trainer(ToyTask(ResidualToy, width=16, batches=batches), ctx, cfg, config_record={"precision": precision})


def test_pure_bf16_state_dtypes_and_exact_resume(world, tmp_path):
    whole = trainer(world, tmp_path / "whole", "bf16-pure")
    want = whole.fit()
    engine = whole.engine
    assert engine.precision == "pure"
    params = list(engine.named_trainable.values())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(engine.optimizer.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
    assert all(t.dtype == torch.float32 for t in engine.ema.shadow.values())
    assert want[-1].loss < want[0].loss

    first = trainer(world, tmp_path / "cut", "bf16-pure", exit_interval=2)
    first.fit()
    resumed = trainer(world, tmp_path / "cut", "bf16-pure")
    got = resumed.fit()
    assert [r.step for r in got] == [3, 4]
    assert [(r.loss, r.grad_norm) for r in got] == [(r.loss, r.grad_norm) for r in want[2:]]
    a, b = Checkpoint(resumed.last_checkpoint), Checkpoint(whole.last_checkpoint)
    assert a.manifest["precision"] == "pure" and set(a.reader.keys()) == set(b.reader.keys())
    for key in b.reader.keys():
        assert torch.equal(a.tensor(key), b.tensor(key)), key

    other = trainer(world, tmp_path / "cut", "fp32", steps=6)
    with pytest.raises(CheckpointReadError, match="saved by a run with the pure precision recipe; this run trains "
                                                  "with the fp32 one"):
        other.fit()


def test_mixed_keeps_fp32_weights(world, tmp_path):
    run = trainer(world, tmp_path, "bf16", steps=1)
    results = run.fit()
    assert run.engine.precision == "mixed"
    assert all(p.dtype == torch.float32 for p in run.engine.named_trainable.values())
    assert results[0].loss == pytest.approx(trainer(world, tmp_path / "p", "bf16-pure", steps=1).fit()[0].loss, rel=2e-2)


def test_records_carry_the_mean_loss_since_the_previous_record(world, tmp_path):
    """``loss`` is the logged step's (one batch's); ``loss_avg`` the mean of the steps since the
    previous record (every ``log.interval`` steps, and the last step)."""
    import json
    import statistics

    results = trainer(world, tmp_path / "run", "fp32", log_interval=2, steps=5).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r.loss for r in results]
    assert [r["step"] for r in records] == [2, 4, 5]
    assert [r["loss"] for r in records] == pytest.approx([losses[1], losses[3], losses[4]])
    assert [r["loss_avg"] for r in records] == pytest.approx(
        [statistics.fmean(losses[0:2]), statistics.fmean(losses[2:4]), losses[4]])
