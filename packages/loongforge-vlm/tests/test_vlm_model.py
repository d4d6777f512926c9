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
