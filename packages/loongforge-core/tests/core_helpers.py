"""Test helpers: a toy ``TorchTask`` (a small regression model, the squared error per element) and
the run config that ``Trainer`` and ``run_training`` read. Importing them imports no megatron-core."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from loongforge.core.training.schema import CheckpointConfig, LogConfig, ParallelConfig, TrainConfig
from loongforge.core.training.task import StepBatch, TorchTask
from loongforge.core.training.torch_model import TorchModel


class Toy(TorchModel):
    """Two linear blocks of ``width`` features, each followed by tanh, and a linear head to one output."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])
        self.head = nn.Linear(width, 1)

    def repeated_blocks(self):
        return list(self.blocks)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class ToyTask(TorchTask):
    """``model(width)`` (default ``Toy``) fit to targets ``y`` of micro-batches ``(x, y)``: the loss
    is the squared error summed in fp32 over ``y``'s element count. ``batches(ctx, step)`` gives a
    step's micro-batches; without it ``steps`` is not there (the test hands the engine its steps)."""

    family = "toy"

    def __init__(self, model: Callable[[int], nn.Module] = Toy, width: int = 8,
                 batches: Callable[[object, int], list] | None = None):
        self.model, self.width, self.batches = model, width, batches

    def model_config_dict(self) -> dict:
        return {"width": self.width}

    def build_model(self, ctx):
        return self.model(self.width)

    def steps(self, ctx, start_step: int):
        if self.batches is None:
            raise NotImplementedError
        batches = self.batches
        return (StepBatch(micro_batches=batches(ctx, step)) for step in itertools.count(start_step))

    def forward(self, model, batch):
        x, y = batch
        return model(x), lambda o: ((o.float() - y).pow(2).sum(), y.numel())


@dataclass
class RunConfig:
    train: TrainConfig
    log: LogConfig
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
