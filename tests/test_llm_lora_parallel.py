"""LoRA under TP=2 (with and without sequence parallelism) and EP=2 (adapters on the routed
experts) trains as one process does: same losses and gradient norms, and the adapters saved by
the sharded run merge (``lf-llm lora merge``) into the same weights as the one-process run's,
which ``lf-llm convert lf-to-hf`` exports."""

import json

import pytest
import torch
from cli_runner import run_cli
from test_llm_moe_parallel import hf_model

from loongforge.core.checkpoint import Checkpoint

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = [
    f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
    "train.warmup_steps=1", "train.lr=0.01", "log.interval=1", "log.progress=false", "log.tensorboard=false",
    "checkpoint.resume=false", "lora.rank=4", "lora.alpha=8",
]
CASES = {
    # dense Llama, TP without sequence parallelism, every default target (SwiGLU fc1 split over TP)
    "llama-tp2": ("train_debug", [], ["parallel.tp=2"]),
    # MoE attention under TP, which megatron's MoE layer runs with sequence parallelism
    "qwen3_moe-tp2": ("train_qwen3_moe_debug", ["lora.target_modules=[linear_qkv,linear_proj]"], ["parallel.tp=2"]),
    # adapters on the routed experts too, experts split over EP
    "qwen3_moe-ep2": ("train_qwen3_moe_debug", [], ["parallel.ep=2"]),
}


@pytest.fixture(scope="module")
def base_weights(tmp_path_factory):
    """Qwen3-MoE debug weights every MoE run starts from (``lora.base``)."""
    from loongforge.core.hf_mapping.convert import hf_to_lf

    root = tmp_path_factory.mktemp("base")
    hf_model("qwen3_moe").save_pretrained(root / "hf")
    hf_to_lf(root / "hf", root / "weights", progress=False)
    return root / "weights"


def train(case, run_dir, data_cache, base, parallel=(), nproc=1):
    config, extra, _ = CASES[case]
    start = [f"lora.base={base}"] if config != "train_debug" else []
    proc = run_cli(["lf-llm", "train", "--config", config, *COMMON, *extra, *start, *parallel,
                    f"log.run_dir={run_dir}", f"data.cache_dir={data_cache}"], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows]


def merge(run_dir, out):
    proc = run_cli(["lf-llm", "lora", "merge", str(run_dir / "checkpoints"), str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Checkpoint(out)


# the MoE cases under -m long (the default tier's time budget: qwen3_moe-ep2 alone is ~100 s on two
# cores): llama-tp2 covers LoRA under TP in the default tier, the long tier the MoE model's adapters
@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.long) if name.startswith("qwen3_moe") else name
                                  for name in sorted(CASES)])
def test_lora_layout_matches_one_process(case, base_weights, tmp_path, llm_data_cache):
    ref = train(case, tmp_path / "ref", llm_data_cache, base_weights)
    got = train(case, tmp_path / "got", llm_data_cache, base_weights, CASES[case][2], nproc=2)
    assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in ref], rel=1e-5)
    assert [norm for _, norm in got] == pytest.approx([norm for _, norm in ref], rel=1e-4)
    ref_merged, got_merged = merge(tmp_path / "ref", tmp_path / "ref-merged"), merge(tmp_path / "got", tmp_path / "got-merged")
    keys = sorted(ref_merged.reader.keys())
    assert keys == sorted(got_merged.reader.keys())
    for key in keys:
        torch.testing.assert_close(got_merged.tensor(key), ref_merged.tensor(key), atol=1e-5, rtol=0, msg=key)
    if case == "qwen3_moe-ep2":
        proc = run_cli(["lf-llm", "convert", "lf-to-hf", str(tmp_path / "got-merged"), str(tmp_path / "hf")])
        assert proc.returncode == 0, proc.stderr[-3000:]
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 4
