"""``lf-llm bench`` on CPU: the smoke run of the GPU benchmark (fp32, the debug model)."""

import re

import pytest
from cli_runner import run_cli

from loongforge.llm.cli import main


def test_bench_runs_ours_variant_and_hf_baseline():
    proc = run_cli(["lf-llm", "bench", "--config", "train_debug", "--steps", "2", "--warmup", "1",
                    "--variant", "selective=train.recompute=selective", "--variant", "big=train.global_batch_size=8",
                    # megatron pins a process to one attention backend; the bench lets each run choose
                    "--variant", "unfused=attention_backend=unfused",
                    "train.global_batch_size=4", "train.micro_batch_size=2"],
                   # the flags an earlier megatron model in the process leaves behind
                   env={"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = proc.stdout
    assert "512 tokens/step (train_debug)" in out  # global batch 4 x 128 tokens
    # the baseline's weights are written and read without transformers' progress bars
    assert "Loading weights" not in proc.stdout + proc.stderr and "Writing model shards" not in proc.stdout + proc.stderr
    order = ["hf_eager", "ours", "selective", "big", "unfused"]
    per_run = {name: (int(tps.replace(",", "")), int(tokens), float(loss)) for name, tps, tokens, loss in re.findall(
        r"^(\w+): [\d.]+ ms/step, ([\d,]+) tokens/s \((\d+) a step\), \S+ GiB, first-step loss ([\d.]+)$",
        out, flags=re.M)}
    assert list(per_run) == order
    assert all(tps > 0 for tps, _, _ in per_run.values())
    # each run counts its own tokens: the variant with twice the global batch trains 2 x 4 x 128
    assert {name: tokens for name, (_, tokens, _) in per_run.items()} == {
        "hf_eager": 512, "ours": 512, "selective": 512, "big": 1024, "unfused": 512}
    # the same weights (HF's, read by ours) and micro-batches: the first-step losses agree in fp32
    reference = per_run["hf_eager"][2]
    assert [per_run[n][2] for n in ("ours", "selective", "unfused")] == pytest.approx([reference] * 3, rel=1e-4)
    assert "first-step loss ours: " in out and "agrees with hf_eager" in out and "DISAGREES" not in out
    assert "first-step loss big: not compared" in out
    # the baseline's settings, its compiled runs skipped on CPU, and alternating rounds
    assert "baseline: transformers LlamaForCausalLM" in out and "compile = True  (requested; CUDA only" in out
    assert "hf_compile, hf_liger: skipped" in out
    assert "round 1 of 2: hf_eager, ours," in out and "round 2 of 2: ours, selective, big, unfused, hf_eager" in out
    assert "spec peak not listed for this device" in out
    header, *rows = out[out.index("\nrun ") + 1 :].strip().splitlines()
    header, rows = header.split(), rows[: len(order)]
    assert header[-1] == "hf_eager" and "spec" in header and [r.split()[0] for r in rows] == order
    assert rows[0].split()[-1] == "1.00"  # the baseline against itself


@pytest.mark.parametrize(("flash", "liger"), [(False, False), (True, True)])
def test_baseline_recipe_is_transformers_gpu_training(flash, liger):
    from loongforge.llm.bench import BASELINES, hf_recipe

    recipe = hf_recipe(flash_attn=flash, liger=liger)
    assert dict(recipe.options) == {"attn_implementation": "flash_attention_2" if flash else "sdpa", "compile": True,
                                    "fused_adamw": True, "tf32": True, "clip_grad": True, "liger_kernel": liger}
    assert recipe.applied("cuda") == dict(recipe.options)
    assert BASELINES == ("hf_compile", "hf_liger", "hf_eager")  # the headline baseline first
    assert any("liger-kernel is not installed" in n for n in recipe.notes) is not liger
    # Liger runs uncompiled: compiled with all its kernels its loss is wrong (bench/liger_check.py)
    assert any(n.startswith("hf_liger: Liger's kernels uncompiled") for n in recipe.notes) is liger


def test_spec_peaks_cover_the_bench_machines():
    from loongforge.core.device_peaks import spec_peak_bf16

    assert spec_peak_bf16("NVIDIA H200") == spec_peak_bf16("NVIDIA H100 80GB HBM3") == 989e12


@pytest.mark.parametrize(("argv", "message"), [
    (["--variant", "ours=train.lr=1"], "give it a name of its own"),
    (["--variant", "hf_x=train.lr=1"], "not starting with hf_"),
    (["--variant", "a=train.lr=1", "--variant", "a=train.lr=2"], "give it a name of its own"),
    (["--variant", "x=attention_backend=flsh"], "attention_backend='flsh': one of"),
    (["--variant", "x=spec.recompute_elementwise=maybe"], "true or false"),
    (["--variant", "x=train.lrr=1"], "lrr"),
    (["--steps", "0"], "at least one timed step"),
    (["--rounds", "0"], "at least one round"),
    (["--variant", "x=train.lr"], "'train.lr' is not of the form key=value"),
    # a list value keeps its commas: the config gets data.weights=[1,2] (no prefixes for the two weights)
    (["--variant", "x=data.weights=[1,2],train.lr=1"], "data.weights has 2 entries for 0 data.prefixes"),
    (["--config", "train_qwen3_moe_debug"], "model.family='qwen3_moe' is not one of llama, qwen2, qwen3, mistral"),
    (["train.stepz=3"], "stepz"),
])
def test_bench_bad_arguments_fail_before_any_run(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "ms/step" not in captured.out  # no run started


def test_bench_refuses_adaptive_fp8_where_nothing_can_be_timed(capsys):
    """``--fp8 adaptive`` times the fused FP8 kernels; where fp8_linear is the torch reference (CPU)
    the bench says so before any run."""
    from loongforge.core.kernels import KernelPolicy
    from loongforge.llm.layers.fp8_measure import fused_fp8_linear

    if fused_fp8_linear(KernelPolicy()):
        pytest.skip("the fused FP8 kernels run here: --fp8 adaptive is a real run")
    assert main(["bench", "--fp8", "adaptive"]) == 2
    captured = capsys.readouterr()
    assert "--fp8=adaptive: fp8_linear runs its torch reference here" in captured.err
    assert "ms/step" not in captured.out


def test_bench_takes_a_config_path_model_overrides_and_the_pure_recipe(tmp_path):
    """A YAML path as ``--config``, a model override (the HF checkpoint every run starts from is
    written from the overridden model), a Qwen3 case (q/k norms, transformers' Qwen3ForCausalLM) and
    pure bf16 on both sides: the first-step losses agree."""
    config = tmp_path / "case.yaml"
    config.write_text("defaults:\n  - model: qwen3_debug\n  - _self_\n"
                      "train: {steps: 5, global_batch_size: 2, micro_batch_size: 2, seq_length: 64}\n")
    proc = run_cli(["lf-llm", "bench", "--config", str(config), "--steps", "1", "--warmup", "1", "--rounds", "1",
                    "--profile-rows", "0", "model.num_layers=3", "train.precision=bf16-pure"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = proc.stdout
    assert "precision recipe: pure bf16" in out and "train.precision=bf16-pure" in out
    assert "baseline: transformers Qwen3ForCausalLM" in out
    assert "128 tokens/step (" in out
    assert "first-step loss ours: " in out and "agrees with hf_eager" in out and "DISAGREES" not in out
    # the model of ours is the overridden one (3 layers), read back from the HF checkpoint
    from loongforge.llm.recipe import load_llm_config

    three = load_llm_config(str(config), ["model.num_layers=3"]).model
    flops = three.flops_per_token(64) / 1e9
    assert f"{flops:.3f} GFLOP/token" in out


def test_bench_times_the_step_lf_llm_train_takes(tmp_path):
    """Ours in the bench is lf-llm train's step: from the same config, weights (the HF checkpoint
    the bench writes) and data, its first-step loss is the one the training run logs for step 1."""
    import torch

    from loongforge.core.metrics import read_metrics
    from loongforge.core.parallel import destroy_parallel
    from loongforge.llm.bench import Run, our_step, save_hf_model
    from loongforge.llm.recipe import load_llm_config

    overrides = ["train.steps=1", "train.global_batch_size=4", "train.micro_batch_size=2", "checkpoint.save=false",
                 f"model.init_from_hf={tmp_path / 'hf'}"]
    save_hf_model(load_llm_config("train_debug", overrides[:-1]), str(tmp_path / "hf"), torch.float32)
    assert main(["train", "--config", "train_debug", *overrides, f"log.run_dir={tmp_path / 'run'}"]) == 0
    logged = [r for r in read_metrics(tmp_path / "run") if r.get("step") == 1]
    cfg = load_llm_config("train_debug", [*overrides, f"log.run_dir={tmp_path / 'bench'}"])
    step, _ = our_step(Run("ours", cfg, {}))
    try:
        assert step() == logged[0]["loss"]
    finally:
        destroy_parallel()
