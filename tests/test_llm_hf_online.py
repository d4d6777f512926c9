"""Online HF interop of `lf-llm train`: `model.init_from_hf=DIR` starts from an HF model directory
(architecture from its config.json, each TP rank reading its shards of the safetensors), and
`--save-hf OUT` exports the final checkpoint as an HF directory transformers loads."""

import json

import pytest
import torch
from cli_runner import run_cli
from hf_models import first_batch_loss, tiny_qwen2
from safetensors.torch import load_file

from loongforge.core.config import ConfigError
from loongforge.llm.recipe import load_llm_config

SEQ, BATCH, STEPS = 32, 4, 2


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from loongforge.llm.data.shipped import bundled_tokenizer_path

    path = tmp_path_factory.mktemp("hf") / "qwen2"
    return path, tiny_qwen2(bundled_tokenizer_path(), path)


def test_the_model_section_comes_from_config_json(hf_dir):
    path, model = hf_dir
    cfg = load_llm_config("train_debug", [f"model.init_from_hf={path}", "train.steps=10"])
    m = cfg.model
    assert (m.family, m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size) == ("qwen2", 2, 64, 128, 1280)
    assert (m.num_attention_heads, m.num_query_groups, m.tie_embeddings, m.add_qkv_bias) == (4, 2, True, True)
    assert m.rotary_base == model.config.rope_parameters["rope_theta"] and m.init_from_hf == str(path.resolve())
    assert cfg.train.steps == 10
    assert "init_from_hf" not in m.architecture()  # checkpoints record and compare the architecture only


def test_bad_uses_are_named(hf_dir, tmp_path):
    path, _ = hf_dir
    with pytest.raises(ConfigError, match=r"model.hidden_size=32.*config.json"):
        load_llm_config("train_debug", [f"model.init_from_hf={path}", "model.hidden_size=32"])
    with pytest.raises(ConfigError, match=r"model.init_from_hf=.*and checkpoint.load=.*both"):
        load_llm_config("train_debug", [f"model.init_from_hf={path}", f"checkpoint.load={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model.init_from_hf=.*nowhere.*not a directory"):
        load_llm_config("train_debug", [f"model.init_from_hf={tmp_path / 'nowhere'}"])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MysteryForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"MysteryForCausalLM.*Qwen2ForCausalLM"):
        load_llm_config("train_debug", [f"model.init_from_hf={tmp_path}"])


def test_bad_save_hf_fails_before_training(hf_dir, tmp_path, capsys):
    from loongforge.llm.cli import main as lf_llm

    path, _ = hf_dir
    assert lf_llm(["train", f"model.init_from_hf={path}", "--save-hf", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--save-hf {path}" in err and "exists" in err
    assert lf_llm(["train", "--save-hf", str(tmp_path / "out"), "checkpoint.save=false"]) == 2
    assert "checkpoint.save=true" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.long  # (the default tier's budget: test_llm_convert trains from an HF import and exports in one process)
def test_train_from_hf_at_tp2_and_export(hf_dir, tmp_path, llm_data_cache):
    """lr=0: the exported tensors are the imported ones bit for bit, and step 1's loss is
    transformers' loss on the same batch (both TP ranks read their halves of the HF tensors)."""
    path, model = hf_dir
    run, out = tmp_path / "run", tmp_path / "exported"
    proc = run_cli(["lf-llm", "train", f"model.init_from_hf={path}", f"train.steps={STEPS}",
                    f"train.global_batch_size={BATCH}", "train.micro_batch_size=2", f"train.seq_length={SEQ}",
                    "train.warmup_steps=0", "train.lr=0", "train.min_lr_ratio=0", f"log.run_dir={run}",
                    f"data.cache_dir={llm_data_cache}", "log.interval=1", "log.progress=false",
                    "log.tensorboard=false", "parallel.tp=2", "--save-hf", str(out)], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] == pytest.approx(first_batch_loss(model, llm_data_cache, SEQ, BATCH, STEPS), rel=1e-5)

    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    before, after = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    manifest = json.loads(next((run / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert "init_from_hf" not in manifest["model_config"]
    assert manifest["config"]["model"]["init_from_hf"] == str(path.resolve())


@pytest.mark.long  # ~90 s on two cores: the default tier's resume tests cover the checkpoint path
def test_resume_reads_the_checkpoint_not_the_hf_weights(hf_dir, tmp_path, llm_data_cache):
    """A resumed run takes every weight from its checkpoint: it must not need (nor read) the HF
    safetensors again, only config.json for the architecture."""
    import shutil

    source, _ = hf_dir
    path = tmp_path / "hf"
    shutil.copytree(source, path)
    run = tmp_path / "run"
    common = [f"model.init_from_hf={path}", f"train.global_batch_size={BATCH}", "train.micro_batch_size=2",
              f"train.seq_length={SEQ}", "train.warmup_steps=0", f"log.run_dir={run}", f"data.cache_dir={llm_data_cache}",
              "log.interval=1", "log.progress=false", "log.tensorboard=false", "checkpoint.interval=2"]
    first = run_cli(["lf-llm", "train", *common, "train.steps=2"])
    assert first.returncode == 0, first.stderr[-5000:]
    (path / "model.safetensors").rename(tmp_path / "moved.safetensors")
    resumed = run_cli(["lf-llm", "train", *common, "train.steps=4"])
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    # a fresh run (nothing to resume) still needs the weights, and says which file is missing
    fresh = run_cli(["lf-llm", "train", *common, "train.steps=2", f"log.run_dir={tmp_path / 'fresh'}"])
    assert fresh.returncode == 2
    assert f"error: model.init_from_hf={path}: {path}: no *.safetensors weights" in fresh.stderr
