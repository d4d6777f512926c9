"""The PyTorch-native engine's update, in one process on CPU, against torch's own recipe: the
gradients of the global mean loss, ``torch.nn.utils.clip_grad_norm_``, then ``torch.optim.AdamW``.
The engine's three paths: loongforge-kernels' ``adamw_step`` with the step's multiplier and
non-finite flag inside its kernel (``train.optimizer_kernel=loongforge``, on CUDA the engine's
default; here the interpreted kernel put in its place), torch's fused AdamW with the same two
inside its kernel (``grad_update.fused_adamw_hooks``; ``train.optimizer_kernel=torch`` on CUDA,
here a fused CPU AdamW), and one multi-tensor multiply before a plain AdamW (CPU's default). A
step whose loss is not finite leaves the weights, moments and step counts as they were."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from core_helpers import RunConfig, ToyTask
from loongforge.core.training.schema import LogConfig, TrainConfig
from loongforge.core.training.task import StepBatch

LR = 1e-2


def micro_batches(seed: int, scale: float = 1.0) -> list:
    g = torch.Generator().manual_seed(seed)
    # two micro-batches of different sizes: the mean is over the step's loss elements, not per micro-batch
    return [(torch.randn(n, 8, generator=g) * scale, torch.randn(n, 1, generator=g)) for n in (3, 5)]


PATHS = ["adamw_step", "fused_adamw", "multiply"]


def engine_for(ctx, tmp_path, clip: float, path: str):
    from loongforge.core.training.loop import Trainer

    cfg = RunConfig(train=TrainConfig(steps=3, global_batch_size=2, micro_batch_size=1, lr=LR, compile=False,
                                      seed=3, clip_grad=clip, precision="fp32"),
                    log=LogConfig(run_dir=str(tmp_path), progress=False, tensorboard=False))
    engine = Trainer(ToyTask(), ctx, cfg).engine
    assert not engine.optimizer.param_groups[0]["fused"]  # CPU: torch's plain AdamW
    assert not engine._own_adamw  # CPU: not the kernel
    if path == "adamw_step":  # what the engine does on CUDA by default: the kernel (interpreted here)
        adamw = pytest.importorskip("loongforge.kernels.adamw")
        engine._adamw_step, engine._own_adamw = adamw.adamw_step, True
    if path == "fused_adamw":  # train.optimizer_kernel=torch on CUDA: a fused AdamW, with no step taken yet
        params = list(engine.named_trainable.values())
        engine.optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True)
    return engine


def reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, clip: float) -> tuple[float, float]:
    """torch's recipe: the global mean loss's gradients, ``clip_grad_norm_``, ``AdamW.step``."""
    count = sum(y.numel() for _, y in batches)
    total = sum((model(x) - y).pow(2).sum() for x, y in batches)
    loss = total / count
    optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    optimizer.step()
    return float(loss.detach()), float(norm)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clip", [0.05, 0.0], ids=["clipped", "unclipped"])
def test_update_equals_torchs_recipe(world, tmp_path, monkeypatch, path, clip):
    from loongforge.core.training import grad_update

    engine = engine_for(world, tmp_path, clip, path)
    hooked = []  # the steps that went through fused AdamW's hooks, and through adamw_step
    kernel_steps = []
    real_hooks, real_groups = grad_update.fused_adamw_hooks, grad_update.adamw_update_groups

    def recording_hooks(optimizers, grad_scale, found_inf):
        hooked.append(float(grad_scale))
        return real_hooks(optimizers, grad_scale, found_inf)

    def recording_groups(optimizer, multiplier, adamw_step, found_inf=None, plans=None):
        kernel_steps.append(float(multiplier))
        return real_groups(optimizer, multiplier, adamw_step, found_inf, plans)

    monkeypatch.setattr(grad_update, "fused_adamw_hooks", recording_hooks)
    monkeypatch.setattr(grad_update, "adamw_update_groups", recording_groups)
    model = engine.inner_model
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for seed in range(3):
        batches = micro_batches(seed)
        want_loss, want_norm = reference_step(ref, ref_opt, batches, clip)
        out = engine.train_step(StepBatch(micro_batches=batches), LR)
        assert out.loss == pytest.approx(want_loss, rel=1e-6)
        assert out.grad_norm == pytest.approx(want_norm, rel=1e-5)
        if clip:
            assert out.grad_norm > clip  # the clipping was applied
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert engine.updates == 3
    assert all(p.grad is None for p in model.parameters())
    # each path took its own way: the kernel, fused AdamW's hooks, or the multiply
    assert (len(kernel_steps), len(hooked)) == {"adamw_step": (3, 0), "fused_adamw": (0, 3), "multiply": (0, 0)}[path]


@pytest.mark.parametrize("path", PATHS)
def test_a_nonfinite_step_changes_nothing(world, tmp_path, path):
    engine = engine_for(world, tmp_path, 1.0, path)
    engine.train_step(StepBatch(micro_batches=micro_batches(0)), LR)
    params = list(engine.named_trainable.values())
    before = [p.detach().clone() for p in params]
    moments = [engine.optimizer.state[p]["exp_avg"].clone() for p in params]
    steps = [engine.optimizer.state[p]["step"].clone() for p in params]
    bad = micro_batches(1)
    bad[0][0][0, 0] = float("nan")
    out = engine.train_step(StepBatch(micro_batches=bad), LR)
    assert out.loss != out.loss  # NaN
    assert engine.updates == 1
    for p, w, m, s in zip(params, before, moments, steps):
        assert torch.equal(p, w) and torch.equal(engine.optimizer.state[p]["exp_avg"], m)
        assert torch.equal(engine.optimizer.state[p]["step"], s)
        assert p.grad is None
    # and the next finite step is applied
    engine.train_step(StepBatch(micro_batches=micro_batches(2)), LR)
    assert engine.updates == 2 and not torch.equal(params[0], before[0])
