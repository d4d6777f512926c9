"""``lf-diffusion train model.pretrained=DIR`` takes the architecture from DIR's config.json, as
``lf-llm`` does with ``model.init_from_hf``: the YAML's architecture keys give way, a conflicting
command-line override is one error line naming both, and Wan 2.2 pipelines give two experts."""

from __future__ import annotations

import json

import torch
from diffusers import WanTransformer3DModel

from loongforge.diffusion.cli import load_recipe, main
from loongforge.diffusion.model.config import WanConfig

# not the tiny config's architecture: 3 layers, 4 heads of 16, ffn 96
ARCH = dict(num_layers=3, num_attention_heads=4, attention_head_dim=16, ffn_dim=96)


def saved(directory, **kw):
    model = WanTransformer3DModel(**(WanConfig(**(ARCH | kw)).diffusers_kwargs()))
    model.save_pretrained(str(directory))
    return model


def test_architecture_comes_from_config_json(tmp_path):
    saved(tmp_path / "wan")
    recipe = load_recipe(None, [f"model.pretrained={tmp_path / 'wan'}", "model.attention_backend=masked"])
    for key, value in ARCH.items():
        assert getattr(recipe.model, key) == value, key
    assert recipe.model.boundary_ratio is None and recipe.model.attention_backend == "masked"  # run keys stay the user's
    agreeing = load_recipe(None, [f"model.pretrained={tmp_path / 'wan'}", "model.num_layers=3"])
    assert agreeing.model.num_layers == 3


def test_training_starts_from_the_pretrained_weights(tmp_path):
    ref = saved(tmp_path / "wan")
    run = tmp_path / "run"
    assert main(["train", f"model.pretrained={tmp_path / 'wan'}", "train.steps=1", "train.global_batch_size=4",
                 "train.lr=0", "train.min_lr_ratio=0", "data.synthetic_clips=8", "log.progress=false",
                 f"log.run_dir={run}", "--save-diffusers", str(tmp_path / "out")]) == 0
    back = WanTransformer3DModel.from_pretrained(str(tmp_path / "out"))
    for key, value in ref.state_dict().items():  # lr 0: the exported weights are the pretrained ones
        assert torch.equal(back.state_dict()[key], value), key


def test_conflicting_override_is_one_error_line(tmp_path, capsys):
    saved(tmp_path / "wan")
    capsys.readouterr()
    assert main(["train", f"model.pretrained={tmp_path / 'wan'}", "model.num_layers=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.num_layers=2" in err[0] and "num_layers=3" in err[0] and "config.json" in err[0]
    assert main(["train", f"model.pretrained={tmp_path / 'missing'}"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_two_expert_pipeline_gives_two_experts_and_the_boundary(tmp_path):
    saved(tmp_path / "pipe" / "transformer")
    saved(tmp_path / "pipe" / "transformer_2")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"boundary_ratio": 0.875}))
    recipe = load_recipe(None, [f"model.pretrained={tmp_path / 'pipe'}"])
    assert recipe.model.boundary_ratio == 0.875 and recipe.model.num_layers == 3
