"""`lf-llm convert lora-to-peft` end to end: a LoRA run from the CLI on a tiny transformers Qwen2.5
(GQA 4/2, q/k/v biases, tied embeddings) changes only the adapters; its PEFT export, loaded by
``peft.PeftModel.from_pretrained`` onto the base's ``lf-llm convert lf-to-hf`` export, gives the logits
of the merged model (``lf-llm lora merge`` -> ``lf-llm convert lf-to-hf`` -> transformers, the same
files as ``lf-to-hf`` of the LoRA checkpoint itself); routed MoE experts, which transformers fuses,
are refused."""

import json

import pytest
import torch
from cli_runner import run_cli
from hf_models import tiny_qwen2
from safetensors.torch import load_file

from loongforge.core.checkpoint import Checkpoint

pytestmark = pytest.mark.slow

RANK, ALPHA = 4, 8.0
COMMON = ["train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=32",
          "train.warmup_steps=0", "train.lr=0.01", "log.progress=false", "log.tensorboard=false",
          "checkpoint.resume=false", f"lora.rank={RANK}", f"lora.alpha={ALPHA}"]
HF_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")


def cli(*args):
    proc = run_cli(["lf-llm", *args])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def logits_of(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.long  # 97 s: in the long tier (the default tier's 20 minutes)
def test_peft_adapter_on_transformers_equals_merged_model(tmp_path, llm_data_cache):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loongforge.llm.data.shipped import bundled_tokenizer_path

    hf_base, base = tmp_path / "hf", tmp_path / "base"
    tiny_qwen2(bundled_tokenizer_path(), hf_base)
    cli("convert", "hf-to-lf", str(hf_base), str(base), "--no-progress")
    run = tmp_path / "run"
    cli("train", "--config", str(base / "train.yaml"), "checkpoint.load=null", f"lora.base={base}", *COMMON,
        f"log.run_dir={run}", f"data.cache_dir={llm_data_cache}")

    # only the adapters changed: every base tensor of the LoRA checkpoint is bitwise the one it started from
    trained, start = Checkpoint(run / "checkpoints"), Checkpoint(base)
    model_keys = {k for k in trained.reader.keys() if not k.startswith("optimizer.")}
    adapters = {k for k in model_keys if k.endswith((".lora_A", ".lora_B"))}
    assert model_keys - adapters == set(start.reader.keys())
    for key in model_keys - adapters:
        assert torch.equal(trained.tensor(key), start.tensor(key)), key
    assert all(trained.tensor(k).abs().max() > 0 for k in adapters if k.endswith(".lora_B"))  # B left zero

    peft_dir = tmp_path / "adapter"
    cli("convert", "lora-to-peft", str(run), str(peft_dir))
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", RANK, ALPHA, "none")
    assert config["target_modules"] == sorted(name.split(".")[1] for name in HF_LAYERS)
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    assert set(tensors) == {f"base_model.model.model.layers.{i}.{layer}.lora_{f}.weight"
                            for i in range(2) for layer in HF_LAYERS for f in "AB"}
    # q/k/v share linear_qkv's A; B's rows are megatron's per-group interleaved rows, de-interleaved
    a = trained.tensor("decoder.layers.self_attention.linear_qkv.lora_A")[1]
    for x in "qkv":
        assert torch.equal(tensors[f"base_model.model.model.layers.1.self_attn.{x}_proj.lora_A.weight"], a)

    merged, hf_merged, hf_direct = tmp_path / "merged", tmp_path / "hf_merged", tmp_path / "hf_direct"
    cli("lora", "merge", str(run / "checkpoints"), str(merged))
    cli("convert", "lf-to-hf", str(merged), str(hf_merged), "--no-progress")
    cli("convert", "lf-to-hf", str(run / "checkpoints"), str(hf_direct), "--no-progress")  # merges as it converts
    direct, via_merge = load_file(hf_direct / "model.safetensors"), load_file(hf_merged / "model.safetensors")
    assert sorted(direct) == sorted(via_merge) and all(torch.equal(direct[k], via_merge[k]) for k in direct)

    exported_base = tmp_path / "hf_base"  # the base as lf-llm exports it (the weights of lora.base)
    cli("convert", "lf-to-hf", str(base), str(exported_base), "--no-progress")
    tokens = torch.randint(0, 1280, (2, 24), generator=torch.Generator().manual_seed(0))
    original = AutoModelForCausalLM.from_pretrained(exported_base, dtype=torch.float32).eval()
    base_logits = logits_of(original, tokens)
    with_adapter = PeftModel.from_pretrained(original, str(peft_dir)).eval()
    reference = logits_of(AutoModelForCausalLM.from_pretrained(hf_merged, dtype=torch.float32).eval(), tokens)
    peft_logits = logits_of(with_adapter, tokens)
    assert (reference - base_logits).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(peft_logits, reference, rtol=0, atol=1e-5)

    proc = run_cli(["lf-llm", "convert", "lora-to-peft", str(run), str(peft_dir)])
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and str(peft_dir) in proc.stderr
    proc = run_cli(["lf-llm", "lora", "export-adapter", str(run), str(tmp_path / "gone")])
    assert proc.returncode == 2  # superseded by `convert lora-to-peft`


def test_routed_expert_adapters_are_refused(tmp_path, llm_data_cache):
    run = tmp_path / "run"
    cli("train", "--config", "train_qwen3_moe_debug", *COMMON, "train.steps=1", f"log.run_dir={run}",
        f"data.cache_dir={llm_data_cache}")
    proc = run_cli(["lf-llm", "convert", "lora-to-peft", str(run), str(tmp_path / "adapter")])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error:") and "\n" not in line
    assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1" in line and "lora.target_modules" in line
    assert not (tmp_path / "adapter").exists()
