"""The composed model in one process: parameter counts of the configs, and which parts learn
under each ``trainable`` setting."""

import pytest
import torch

from loongforge.vlm.parallel import split_items

FAST = ["train.global_batch_size=4", "train.warmup_steps=1", "train.steps=2", "log.progress=false",
        "log.tensorboard=false", "checkpoint.save=false"]


def trainer_for(overrides, ctx, tmp_path, cache):
    from loongforge.core.training.loop import Trainer
    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.recipe import VLMTask

    cfg = load_vlm_config("vlm_debug", [*FAST, f"data.cache_dir={cache}", f"log.run_dir={tmp_path}", *overrides])
    return cfg, Trainer(VLMTask(cfg), ctx, cfg)


@pytest.mark.parametrize("parts", [[], ["encoder=siglip_vit_debug", "projector=mlp_2x", "foundation=llama_debug"]],
                         ids=["qwen2_5_vl", "siglip-llama"])
def test_parameter_counts_match_the_built_model(parts, megatron_world, tmp_path, vlm_cache):
    cfg, trainer = trainer_for(parts, megatron_world, tmp_path, vlm_cache)
    model = trainer.model.module
    built = {name: sum(p.numel() for p in getattr(model, attr).parameters())
             for name, attr in (("encoder", "encoder"), ("projector", "projector"), ("foundation", "language_model"))}
    assert cfg.model().parameter_counts() == built


@pytest.mark.parametrize("trainable", [["projector"], ["projector", "foundation"]])
def test_only_trainable_parts_change(trainable, megatron_world, tmp_path, vlm_cache):
    _, trainer = trainer_for([f"trainable=[{','.join(trainable)}]"], megatron_world, tmp_path, vlm_cache)
    model = trainer.model.module
    parts = {"encoder": model.encoder, "projector": model.projector, "foundation": model.language_model}
    before = {name: [p.detach().clone() for p in part.parameters()] for name, part in parts.items()}
    results = trainer.fit()
    assert len(results) == 2
    for name, part in parts.items():
        changed = [not torch.equal(a, p) for a, p in zip(before[name], part.parameters())]
        assert all(changed) if name in trainable else not any(changed), name


def test_images_are_shared_out_by_patches():
    assert split_items([64, 16, 48, 16], 2) == [[0, 3], [1, 2]]  # largest first to the lighter rank: 80 and 64
    assert split_items([10], 2) == [[0], []]  # a rank may get none; it still joins the gather


QWEN3_VL = ["encoder=qwen3_vit_debug", "projector=qwen3_vl_merger", "foundation=qwen3_debug",
            "vision.rope=mrope_interleaved"]
SIGLIP_LLAMA = ["encoder=siglip_vit_debug", "projector=mlp_2x", "foundation=llama_debug"]


@pytest.mark.parametrize("parts", [[], QWEN3_VL, SIGLIP_LLAMA],
                         ids=["qwen2_5_vl", "qwen3_vl-deepstack", "siglip-llama-1d-rope"])
def test_thd_rows_match_the_dense_document_mask(parts, megatron_world, tmp_path, vlm_cache):
    """Three samples packed as a THD row (cu_seqlens, per-token multimodal RoPE angles) give the
    per-token losses and the gradients of the same row under the dense document-causal mask."""
    from loongforge.vlm.data.packing import pack, pack_thd

    _, trainer = trainer_for(parts, megatron_world, tmp_path, vlm_cache)
    task, model = trainer.task, trainer.model.module
    samples = [task.dataset()[i] for i in range(3)]
    params = [p for p in model.parameters() if p.requires_grad]
    runs = []
    for batch in (pack(samples), pack_thd(samples)):
        output, loss_fn = task.forward(model, batch)
        runs.append((output.detach(), torch.autograd.grad(loss_fn(output)[0], params, allow_unused=True)))
    (dense, dense_grads), (thd, thd_grads) = runs
    assert pack(samples)["attention_mask"] is not None
    torch.testing.assert_close(thd, dense, rtol=1e-5, atol=1e-6)
    assert [g is None for g in thd_grads] == [g is None for g in dense_grads]
    assert sum(g is not None for g in dense_grads) > len(params) // 2
    for a, b in zip(thd_grads, dense_grads):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("parts", [[], QWEN3_VL], ids=["qwen2_5_vl", "qwen3_vl-deepstack"])
def test_decoupled_encoder_matches_coupled(parts, megatron_world, tmp_path, vlm_cache):
    """parallel.encoder.decoupled=true without pipeline parallelism: the tower encodes the step's
    micro-batches' images in one forward before the schedule and runs one backward after it; the
    step's loss, grad norm and every gradient (the tower's and DeepStack's included) are those of the
    coupled step, where each micro-batch encodes its own images."""
    cfg, trainer = trainer_for(["train.global_batch_size=6", "train.seq_length=384", *parts], megatron_world,
                               tmp_path, vlm_cache)
    engine, model = trainer.engine, trainer.engine.inner_model
    step = next(iter(trainer.task.steps(megatron_world, 0)))
    assert len(step.micro_batches) >= 2
    tower, calls = model._tower, []
    model._tower = lambda pixels, grid: calls.append(grid.shape[0]) or tower(pixels, grid)
    runs = []
    for decoupled in (False, True):
        cfg.parallel.encoder.decoupled = decoupled
        calls.clear()
        out = engine.forward_backward(step)
        # the per-token mean gradients (the buffers hold the sums over the step's loss tokens)
        loss_tokens = sum(int(micro["loss_mask"].sum()) for micro in step.micro_batches)
        grads = {n: p.main_grad / loss_tokens for n, p in model.named_parameters() if p.requires_grad}
        runs.append((out, grads, list(calls)))
    (coupled, reference, per_micro_batch), (got, grads, batched) = runs
    assert len(per_micro_batch) == len(step.micro_batches) and batched == [sum(per_micro_batch)]
    assert got.loss == pytest.approx(coupled.loss, rel=1e-6)
    assert got.grad_norm == pytest.approx(coupled.grad_norm, rel=1e-5)
    assert any(n.startswith("encoder.") and g.abs().sum() > 0 for n, g in reference.items())
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
