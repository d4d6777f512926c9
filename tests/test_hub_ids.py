"""Hugging Face Hub ids where configs take paths (``loongforge.core.hub``), resolved offline against a
hub cache the test builds in the layout ``huggingface_hub`` reads (``models--owner--name/refs/main``
and ``snapshots/<commit>/``): lf-llm's ``model.init_from_hf``, lf-diffusion's ``model.pretrained``,
lf-embodied's ``data.path`` (a dataset repository) and ``model.pretrained``; an id in neither the
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
    cfg = load_train_config("train", ["data.path=lerobot/pusht", "model.pretrained=lerobot/pi05_base"])
    assert cfg.data.path == str(dataset)
    assert cfg.model.pretrained == str(policy / "model.safetensors")
    local = load_train_config("train", [f"data.path={dataset}"])  # a path stays a path
    assert local.data.path == str(dataset)
    tokenizer = snapshot(hub, "model", "google/paligemma-3b-pt-224")  # data.tokenizer: a model repository
    (tokenizer / "tokenizer.json").write_text("{}")
    assert load_train_config("train", ["data.tokenizer=google/paligemma-3b-pt-224"]).data.tokenizer == str(tokenizer)


def _word_tokenizer(path, words: int) -> None:
    """A word-level tokenizer of ``words`` tokens (+ the end-of-document token) in ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def test_convert_and_preprocess_take_hub_ids(hub, tmp_path, capsys):
    """``convert hf-to-lf OWNER/NAME OUT`` and ``preprocess --tokenizer OWNER/NAME`` read the cached
    snapshot (they refused an id as "not a directory"); an uncached id is one line naming it."""
    from loongforge.llm.data.shipped import bundled_tokenizer_path

    tiny_qwen2(bundled_tokenizer_path(), snapshot(hub, "model", "acme/tiny-qwen2"))
    assert lf_llm(["convert", "hf-to-lf", "acme/tiny-qwen2", str(tmp_path / "lf"), "--no-progress"]) == 0
    assert (tmp_path / "lf" / "latest").exists() and (tmp_path / "lf" / "train.yaml").is_file()
    text = tmp_path / "doc.txt"
    text.write_text("hello world\n\nanother paragraph\n")
    assert lf_llm(["preprocess", "--input", str(text), "--tokenizer", "acme/tiny-qwen2",
                   "--output-prefix", str(tmp_path / "doc")]) == 0
    assert (tmp_path / "doc.bin").is_file()
    capsys.readouterr()
    assert lf_llm(["convert", "hf-to-lf", "acme/not-cached", str(tmp_path / "lf2")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: convert hf-to-lf SOURCE=acme/not-cached") and "not a directory" not in line


def test_llm_data_tokenizer_is_resolved_and_honoured(hub, tmp_path, capsys):
    """``data.tokenizer`` (a hub id too) is the tokenizer of the run: it tokenizes the bundled corpus
    and must fit the model's vocabulary (it was silently replaced by the bundled one)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from loongforge.llm.data.shipped import bundled_prefix, bundled_tokenizer_path

    small = snapshot(hub, "model", "acme/words")
    _word_tokenizer(small, 50)
    assert load_llm_config("train_debug", ["data.tokenizer=acme/words"]).data.tokenizer == str(small)
    ours, bundled = bundled_prefix(tmp_path / "cache", small), bundled_prefix(tmp_path / "cache", None)
    assert ours != bundled
    top = {}
    for name, prefix in (("ours", ours), ("bundled", bundled)):
        dataset = IndexedDataset(str(prefix))  # held while its memory-mapped documents are read
        top[name] = max(int(dataset[i].max()) for i in range(20))
    assert top["ours"] < 52 <= top["bundled"]  # the word tokenizer's ids, not the bundled one's
    big = snapshot(hub, "model", "acme/big-words")
    _word_tokenizer(big, 5000)
    capsys.readouterr()
    assert lf_llm(["train", "data.tokenizer=acme/big-words", f"log.run_dir={tmp_path / 'run'}"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: tokenizer data.tokenizer={big} has 5002 tokens, more than model.vocab_size=4096")
    assert not (tmp_path / "run").exists()
