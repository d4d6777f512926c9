"""Train an LLM config for ``train.steps`` and record the losses and the first step's gradients.

    python llm_grad_probe.py OUT.pt CONFIG [key=value ...]                      # one process
    torchrun --nproc-per-node=2 llm_grad_probe.py OUT.pt CONFIG [key=value ...]  # e.g. parallel.cp=2

Tests call ``probe`` (which runs this file as a script, on CPU) and compare two runs with
``assert_same_training``.

The gradients are every parameter's ``main_grad`` just before the first optimizer step (after
megatron's reduction over the DP x CP group and the per-token scaling): whole on every rank when
TP is 1, gathered over the pipeline stages under the one-process names (``pipeline_gradients``) when
PP is above 1. Rank 0 writes them with the per-step losses and grad norms, and the shape of
the tokens of its first micro-batch (this rank's share under context parallelism), how TP
splits the parameters it holds shards of (``tp_split``: dim and stride), how many
micro-batches ran through a schedule plan (megatron's combined 1F1B schedule: MoE A2A overlap),
and (``probe(..., whole_grads=True)``) every gradient whole under its checkpoint key, put together
from every rank's regions of it as the model's sharded state dict describes them
(``checkpoint_gradients``: layouts TP splits other than by megatron's dim and stride compare whole).
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

COMMON = ["train.steps=2", "train.warmup_steps=1", "log.progress=false", "log.tensorboard=false",
          "checkpoint.save=false"]
PRETRAIN = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=64"]


WHOLE_GRADS = "--whole-grads"


def probe(out: Path, config: str, overrides: list[str], cache: Path, nproc: int = 1, whole_grads: bool = False) -> dict:
    """Run this probe on ``nproc`` CPU processes and return what rank 0 recorded."""
    from cli_runner import run_script

    args = [str(out), config, *COMMON, f"data.cache_dir={cache}", f"log.run_dir={out.parent / 'run'}", *overrides,
            *([WHOLE_GRADS] if whole_grads else [])]
    proc = run_script(Path(__file__), args, nproc=nproc, env={"LOONGFORGE_ACCELERATOR": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def assert_same_training(got: dict, want: dict, grads: bool = True) -> None:
    """The same losses, grad norms and first-step gradient of every parameter (rtol 1e-4); where
    ``got`` is a tensor-parallel run, its TP rank 0's shard of each split one (``got["tp_split"]``);
    ``grads=False``: losses and grad norms only."""
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-4)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)
    if not grads:
        return
    assert sorted(got["grads"]) == sorted(want["grads"]) and want["grads"]
    split = got.get("tp_split", {})
    for name, ref in want["grads"].items():
        if name in split:
            ref = first_shard(ref, got["grads"][name].shape, *split[name])
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def first_shard(whole: torch.Tensor, shape, dim: int, stride: int) -> torch.Tensor:
    """TP rank 0's shard (of ``shape``) of a parameter megatron splits along ``dim``, in
    ``stride`` interleaved blocks (2: a GLU's [gate, up] rows, each split over TP)."""
    tp = whole.shape[dim] // shape[dim]
    return torch.cat([block.chunk(tp, dim)[0] for block in whole.chunk(stride, dim)], dim)


def pipeline_gradients(model, pp_group, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's gradients under the one-process names: a stage's local decoder-layer index
    becomes megatron's global one (``layer_number`` counts from 1 across stages). With tied
    embeddings the last stage's copy of the word embeddings (its output layer) must hold the first
    stage's gradient (megatron all-reduces the two); it is checked and dropped."""
    if pp_group.size() == 1:
        return grads
    prefix, layers = "decoder.layers.", model.decoder.layers

    def one_process_name(name: str) -> str:
        if not name.startswith(prefix):
            return name
        local, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{layers[int(local)].layer_number - 1}.{rest}"

    stages = [None] * pp_group.size()
    dist.all_gather_object(stages, {one_process_name(n): g for n, g in grads.items()}, group=pp_group)
    merged = {name: g for stage in stages for name, g in stage.items()}
    if model.share_embeddings_and_output_weights and "output_layer.weight" in merged:
        torch.testing.assert_close(merged.pop("output_layer.weight"), merged["embedding.word_embeddings.weight"])
    return merged


def checkpoint_gradients(model, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every gradient of ``grads`` (by parameter name, this rank's) whole, under its checkpoint key:
    the model's sharded state dict made with each gradient in its parameter's place, every rank's
    primary regions gathered and put together (on every rank)."""
    params = dict(model.named_parameters())
    weights = {name: p.data for name, p in params.items()}
    try:
        for name, grad in grads.items():
            params[name].data = grad.to(params[name].dtype)
        return whole_state(model, as_float=True)
    finally:
        for name, p in params.items():
            p.data = weights[name]


def whole_state(model, as_float: bool = False) -> dict[str, torch.Tensor]:
    """``model``'s sharded state dict whole under its checkpoint keys, on every rank: every rank's
    primary regions gathered and put together (in fp32 with ``as_float``)."""
    from loongforge.core.checkpoint.sharded import flatten_for_save

    pieces, _, _ = flatten_for_save(model.sharded_state_dict())
    mine = [(p.key, p.global_shape, p.global_offset, (p.tensor.float() if as_float else p.tensor).detach().clone())
            for p in pieces]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    whole = {}
    for key, shape, offset, tensor in (piece for rank in every for piece in rank):
        t = whole.setdefault(key, torch.full(shape, float("nan")))
        t[tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape))] = tensor
    return whole


def main(out: str, config: str, overrides: list[str]) -> None:
    from loongforge.core.config import to_dict
    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.core.training.loop import Trainer
    from loongforge.llm.recipe import load_llm_config
    from loongforge.llm.recipe_task import make_task

    whole_grads = WHOLE_GRADS in overrides
    cfg = load_llm_config(config, [o for o in overrides if o != WHOLE_GRADS])
    task = make_task(cfg)
    p = cfg.parallel
    ctx = init_parallel(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, seed=cfg.train.seed)
    task.prepare(ctx)
    trainer = Trainer(task, ctx, cfg, config_record=to_dict(cfg))
    module = trainer.inner_model
    captured, whole = {}, {}
    step = trainer.engine.optimizer.step_with_ready_grads

    def capture_then_step():
        if not captured:
            local = {name: p.main_grad.detach().float().clone()
                     for name, p in module.named_parameters() if getattr(p, "main_grad", None) is not None}
            captured.update(pipeline_gradients(module, ctx.pgs.pp, local))
            if whole_grads:
                whole.update(checkpoint_gradients(module, local))
        return step()

    trainer.engine.optimizer.step_with_ready_grads = capture_then_step
    shapes = []
    forward, schedule_plan = task.forward, task.schedule_plan

    plans = []  # per micro-batch: whether megatron's combined 1F1B schedule asked for a plan

    def recording_forward(model, batch):
        shapes.append(tuple(batch["tokens"].shape))
        plans.append(False)
        return forward(model, batch)

    def recording_schedule_plan(model, batch):
        shapes.append(tuple(batch["tokens"].shape))
        plans.append(True)
        return schedule_plan(model, batch)

    task.forward, task.schedule_plan = recording_forward, recording_schedule_plan
    results = trainer.fit()
    if ctx.rank == 0:
        torch.save({"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
                    "grads": captured, "first_tokens_shape": shapes[0],
                    # rank 0's own (one pipeline stage's) names
                    "tp_split": {name: (p.partition_dim, p.partition_stride) for name, p in module.named_parameters()
                                 if getattr(p, "tensor_model_parallel", False) and ctx.layout.tp > 1},
                    "schedule_plans": sum(plans), "whole_grads": whole}, out)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
