"""Train a few steps of a VLM config and record the losses and the first step's full gradients.

    python grads_probe.py OUT.pt [key=value ...]                      # one process
    torchrun --nproc-per-node=2 grads_probe.py OUT.pt [key=value ...]  # any layout

The gradients are read just before the first optimizer step (after megatron's reduction and
per-token scaling), gathered across the foundation's TP group into full tensors and across its
pipeline stages under the one-process names (``pipeline_gradients``), and written by rank 0 with the per-step losses and grad norms (and the
shapes of its first micro-batch's tokens and labels: under context parallelism the labels are
the rank's share of the row).
"""

import sys

import torch
import torch.distributed as dist


def gated(model, name: str) -> bool:
    """Whether ``name`` is the fused [gate; up] linear_fc1 of a SwiGLU MLP (sharded as [gate part; up part])."""
    part = {"encoder": getattr(model, "encoder", None), "language_model": model.language_model}.get(name.split(".")[0])
    return part is not None and part.config.gated_linear_unit and ".mlp.linear_fc1." in name


def delta_net_sections(model, name: str) -> list[int] | None:
    """The q, k, v channel counts of a Gated DeltaNet's fused ``in_proj_qkv`` / ``conv1d`` (each
    section split over TP: a shard is [q part; k part; v part]); None for other parameters."""
    if not name.endswith(("self_attention.in_proj_qkv.weight", "self_attention.conv1d.weight")):
        return None
    f = model.cfg.foundation
    qk = f.linear_num_key_heads * f.linear_key_head_dim
    return [qk, qk, f.linear_num_value_heads * f.linear_value_head_dim]


def full_gradients(model, ctx) -> dict[str, torch.Tensor]:
    tp = ctx.pgs.tp
    out = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            continue
        g = g.detach().float().clone()
        if getattr(p, "tensor_model_parallel", False) and tp.size() > 1:
            shards = [torch.empty_like(g) for _ in range(tp.size())]
            dist.all_gather(shards, g.contiguous(), group=tp)
            dim = p.partition_dim
            sections = delta_net_sections(model, name)
            if gated(model, name):
                halves = [s.chunk(2, dim=dim) for s in shards]  # each shard is [gate part; up part]
                g = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
            elif sections is not None:
                parts = [s.split([n // tp.size() for n in sections], dim=dim) for s in shards]
                g = torch.cat([p[i] for i in range(3) for p in parts], dim=dim)
            else:
                g = torch.cat(shards, dim=dim)
        out[name] = g
    return out


def global_layer_name(model, name: str) -> str:
    """``name`` with a pipeline stage's local foundation layer index replaced by the layer's global
    one (megatron's ``layer_number`` counts from 1 across stages)."""
    prefix = "language_model.decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix):].split(".", 1)
    return f"{prefix}{model.language_model.decoder.layers[int(local)].layer_number - 1}.{rest}"


def pipeline_gradients(model, ctx, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's gradients under the one-process names. With tied embeddings the last stage's
    copy of the word embeddings (its output layer) must hold the first stage's gradient (megatron
    all-reduces the two); it is checked and dropped, as one process has only the embedding."""
    pp = ctx.pgs.pp
    if pp.size() == 1:
        return grads
    mine = {global_layer_name(model, n): g for n, g in grads.items()}
    stages = [None] * pp.size()
    dist.all_gather_object(stages, mine, group=pp)
    out = {}
    for stage in stages:
        out.update(stage)
    tied = "language_model.output_layer.weight"
    if model.language_model.share_embeddings_and_output_weights and tied in out:
        torch.testing.assert_close(out.pop(tied), out["language_model.embedding.word_embeddings.weight"])
    return out


def main(out: str, overrides: list[str]) -> None:
    from loongforge.core.config import to_dict
    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.core.training.loop import Trainer
    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.recipe import VLMTask

    cfg = load_vlm_config("vlm_debug", overrides)
    task = VLMTask(cfg)
    ctx = init_parallel(tp=cfg.parallel.tp, pp=cfg.parallel.pp, cp=cfg.parallel.cp, seed=cfg.train.seed)
    trainer = Trainer(task, ctx, cfg, config_record=to_dict(cfg))
    module = trainer.model.module
    captured = {}
    step = trainer.engine.optimizer.step_with_ready_grads

    def capture_then_step():
        if not captured:
            captured.update(pipeline_gradients(module, ctx, full_gradients(module, ctx)))
        return step()

    trainer.engine.optimizer.step_with_ready_grads = capture_then_step
    forward = task.forward
    shapes = {}

    def record_shapes_then_forward(model, batch):
        # the first micro-batch's row (whole, as collated) and this rank's labels (its CP share)
        shapes.setdefault("first_row", (tuple(batch["tokens"].shape), tuple(batch["labels"].shape)))
        return forward(model, batch)

    task.forward = record_shapes_then_forward
    # how many items this rank's tower encoded in the first forward, of the micro-batch's items
    vlm = next((m for m in module.modules() if hasattr(m, "_tower")), None)
    counts = {"first": True, "encoded": 0}
    if vlm is not None:
        tower = vlm._tower

        def counting_tower(pixels, grid):
            if counts["first"]:
                counts["encoded"] += int(grid.shape[0])
            return tower(pixels, grid)

        def record_items_then_forward(model, batch):
            if counts["first"] and "grid_thw" in batch:
                shapes["first_items"] = int(batch["grid_thw"].shape[0])
            try:
                return record_shapes_then_forward(model, batch)
            finally:
                if "first_items" in shapes and counts["first"]:
                    counts["first"] = False
                    shapes["first_items"] = (counts["encoded"], shapes["first_items"])

        vlm._tower = counting_tower
        task.forward = record_items_then_forward
    results = trainer.fit()
    if ctx.rank == 0:
        torch.save({"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
                    "grads": captured,
                    "first_row": shapes.get("first_row"), "first_items": shapes.get("first_items")}, out)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
