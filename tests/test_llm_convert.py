"""`lf-llm convert` end to end: a tiny transformers Qwen2.5 model -> LoongForge checkpoint ->
2 training steps at TP=2 (its first loss is transformers' loss on the same batch) -> back to HF."""

import json

import pytest
import torch
from cli_runner import run_cli
from hf_models import first_batch_loss, tiny_qwen2
from safetensors.torch import load_file

SEQ, BATCH, STEPS = 32, 4, 2


def test_convert_train_from_it_and_export(tmp_path, llm_data_cache):
    from loongforge.llm.data.shipped import bundled_tokenizer_path

    hf_dir = tmp_path / "hf"
    model = tiny_qwen2(bundled_tokenizer_path(), hf_dir)
    lf = tmp_path / "lf"
    proc = run_cli(["lf-llm", "convert", "hf-to-lf", str(hf_dir), str(lf), "--no-progress"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "qwen2" in proc.stdout and (lf / "train.yaml").is_file()

    run = tmp_path / "run"
    proc = run_cli(["lf-llm", "train", "--config", str(lf / "train.yaml"), f"train.steps={STEPS}",
                    f"train.global_batch_size={BATCH}", "train.micro_batch_size=2", f"train.seq_length={SEQ}",
                    "train.warmup_steps=0", f"log.run_dir={run}", f"data.cache_dir={llm_data_cache}", "log.interval=1",
                    "log.progress=false", "log.tensorboard=false", "parallel.tp=2"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS
    assert losses[0] == pytest.approx(first_batch_loss(model, llm_data_cache, SEQ, BATCH, STEPS), rel=1e-5)

    out = tmp_path / "exported"
    proc = run_cli(["lf-llm", "convert", "lf-to-hf", str(run / "checkpoints"), str(out), "--no-progress"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    before, after = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.bias"], after["model.layers.0.self_attn.q_proj.bias"])


def test_convert_reports_unknown_architecture(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["MysteryForCausalLM"]}))
    (hf_dir / "model.safetensors").write_bytes(b"")
    proc = run_cli(["lf-llm", "convert", "hf-to-lf", str(hf_dir), str(tmp_path / "lf")])
    assert proc.returncode == 2
    assert "MysteryForCausalLM" in proc.stderr and "Qwen3ForCausalLM" in proc.stderr
