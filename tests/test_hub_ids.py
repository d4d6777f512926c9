"""Hugging Face Hub ids where configs take paths (``loongforge.core.hub``), resolved offline against a
hub cache the test builds in the layout ``huggingface_hub`` reads (``models--owner--name/refs/main``
and ``snapshots/<commit>/``): lf-llm's ``model.init_from_hf``, lf-diffusion's ``model.pretrained``,
lf-embodied's ``data.root`` (a dataset repository) and ``policy.pretrained``; an id in neither the
cache nor reachable is one error line naming the key and the id."""

from __future__ import annotations

import json

import pytest
from diffusers import WanTransformer3DModel
from hf_models import tiny_qwen2

from loongforge.diffusion.cli import load_recipe
from loongforge.diffusion.model.config import WanConfig
from loongforge.embodied.config import load_train_config
from loongforge.llm.cli import main as lf_llm
from loongforge.llm.recipe import load_llm_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def snapshot(cache, repo_type: str, repo_id: str):
    """The snapshot directory of ``repo_id`` in a hub cache, with ``refs/main`` pointing at it."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    path = repo / "snapshots" / COMMIT
    path.mkdir(parents=True)
    return path


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_llm_trains_from_a_cached_hub_id(hub, tmp_path):
    from loongforge.llm.data.shipped import bundled_tokenizer_path

    path = snapshot(hub, "model", "acme/tiny-qwen2")
    tiny_qwen2(bundled_tokenizer_path(), path)
    for value in ("acme/tiny-qwen2", "acme/tiny-qwen2@main"):
        cfg = load_llm_config("train_debug", [f"model.init_from_hf={value}"])
        assert cfg.model.init_from_hf == str(path.resolve()) and cfg.model.family == "qwen2"
    assert lf_llm(["train", "model.init_from_hf=acme/tiny-qwen2", "train.steps=1", "train.seq_length=32",
                   "train.global_batch_size=2", "checkpoint.save=false", "log.progress=false",
                   f"log.run_dir={tmp_path / 'run'}"]) == 0
    loss = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert 5.0 < loss < 9.0  # a random tiny model over a 1280-token vocabulary: about ln(1280)


def test_an_uncached_id_offline_is_one_error_line(hub, capsys):
    capsys.readouterr()
    assert lf_llm(["train", "model.init_from_hf=acme/not-cached"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: model.init_from_hf=acme/not-cached"), err
    assert "HF_HUB_OFFLINE" in err[0] and "hf download acme/not-cached" in err[0]


def test_diffusion_pretrained_id(hub):
    path = snapshot(hub, "model", "acme/tiny-wan")
    WanTransformer3DModel(**WanConfig(num_layers=3).diffusers_kwargs()).save_pretrained(str(path))
    recipe = load_recipe(None, ["model.pretrained=acme/tiny-wan"])
    assert recipe.model.pretrained == str(path) and recipe.model.num_layers == 3


def test_embodied_dataset_and_policy_ids(hub):
    dataset = snapshot(hub, "dataset", "lerobot/pusht")
    (dataset / "meta").mkdir()
    policy = snapshot(hub, "model", "lerobot/pi05_base")
    (policy / "model.safetensors").write_bytes(b"")
    cfg = load_train_config("train", ["data.root=lerobot/pusht", "policy.pretrained=lerobot/pi05_base"])
    assert cfg.data.root == str(dataset)
    assert cfg.policy.pretrained == str(policy / "model.safetensors")
    local = load_train_config("train", [f"data.root={dataset}"])  # a path stays a path
    assert local.data.root == str(dataset)
    tokenizer = snapshot(hub, "model", "google/paligemma-3b-pt-224")  # policy.tokenizer: a model repository
    (tokenizer / "tokenizer.json").write_text("{}")
    assert load_train_config("train", ["policy.tokenizer=google/paligemma-3b-pt-224"]).policy.tokenizer == str(tokenizer)
