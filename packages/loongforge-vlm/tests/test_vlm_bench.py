"""``lf-vlm bench`` on CPU: the smoke run of the GPU benchmark (the debug parts, fp32). Both models
start from the same weights, so their first-step losses must agree."""

import re

import pytest

from loongforge.vlm.cli import main


def test_bench_runs_baseline_ours_and_a_variant_on_the_same_weights():
    from cli_runner import run_cli

    proc = run_cli(["lf-vlm", "bench", "--tiny", "--steps", "1", "--warmup", "1", "--profile-rows", "0",
                    "--variant", "unpacked=pack=1"], env={"LOONGFORGE_ACCELERATOR": "cpu"})
    # the baseline's settings are printed; on CPU the CUDA-only ones are requested, not applied
    assert "baseline: transformers Qwen2_5_VLForConditionalGeneration" in proc.stdout
    assert "compile = True  (requested; CUDA only, not applied on cpu)" in proc.stdout
    # two rounds: the baseline first, then ours first
    assert "round 1 of 2: hf_eager, ours, unpacked" in proc.stdout
    assert "round 2 of 2: ours, unpacked, hf_eager" in proc.stdout
    assert proc.returncode == 0, proc.stderr[-5000:]
    runs = {name: (float(tps.replace(",", "")), float(loss)) for name, tps, loss in re.findall(
        r"^(\w+): [\d.]+ ms/step, ([\d,]+) tokens/s, peak memory \S+ GiB, first-step loss ([\d.]+)$",
        proc.stdout, flags=re.M)}
    assert set(runs) == {"hf_eager", "ours", "unpacked"}, proc.stdout
    assert all(tps > 0 for tps, _ in runs.values())
    reference = runs["hf_eager"][1]
    assert [loss for _, loss in runs.values()] == pytest.approx([reference] * 3, rel=1e-4)
    assert "2 samples x" in proc.stdout and "images 32x32)" in proc.stdout
    rows = proc.stdout[proc.stdout.index("\nrun ") + 1 :].strip().splitlines()
    assert rows[0].split()[-1] == "hf_eager" and rows[1].split()[-1] == "1.00"
    assert "first-step loss unpacked" in proc.stdout and "agrees with hf_eager" in proc.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--samples", "3", "--pack", "2"], "--samples 3 must be a positive multiple of --pack 2"),
    (["--variant", "ours=pack=1"], "give it a name of its own"),
    (["--variant", "v=pack=3"], "pack=3 must divide the 2 samples"),
    (["--variant", "v=pack=two"], "pack takes a whole number"),
    (["--variant", "v=train.lr"], "'train.lr' is not of the form key=value"),
    # a list value keeps its commas: the encoder gets full_attention_layers=[0,9] (the debug one has 2 layers)
    (["--variant", "v=encoder.full_attention_layers=[0,9],pack=1"], "[9] outside 0..1"),
    (["--variant", "hf_compile=pack=1"], "not starting with hf_"),
    (["--rounds", "0"], "at least one round"),
    (["--variant", "v=parallel.encoder.recompte=full"], "recompte"),
    (["--steps", "0"], "at least one timed step"),
])
def test_bench_bad_arguments_fail_before_any_run(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_ACCELERATOR", "cpu")
    assert main(["bench", "--tiny", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "ms/step" not in captured.out  # no run started


@pytest.mark.parametrize("flash", [True, False])
def test_baseline_recipe_uses_flash_attention_where_installed_and_compiles(flash):
    from loongforge.vlm.bench import BASELINES, hf_recipe

    recipe = hf_recipe(flash_attn=flash)
    assert dict(recipe.options) == {"attn_implementation": "flash_attention_2" if flash else "sdpa", "compile": True,
                                    "fused_adamw": True, "tf32": True}
    assert recipe.applied("cuda") == dict(recipe.options)
    assert BASELINES[0] == "hf_compile"  # the headline baseline is the compiled one


def test_baseline_recipe_follows_the_installed_flash_attn():
    from loongforge.vlm.bench import flash_attn_installed, hf_recipe

    expected = "flash_attention_2" if flash_attn_installed() else "sdpa"
    assert hf_recipe()["attn_implementation"] == expected


def test_bench_runs_qwen3_vl_on_images_of_mixed_sizes():
    """A Qwen3-VL composition (transformers' Qwen3VLForConditionalGeneration) on images of two
    sizes, the text filling every sample to one length: the first-step losses agree."""
    from cli_runner import run_cli

    proc = run_cli(["lf-vlm", "bench", "--config", "qwen3_vl_debug", "--image-sizes", "32x32,64x32", "--seq-tokens", "40",
                    "--samples", "2", "--steps", "1", "--warmup", "1", "--rounds", "1", "--profile-rows", "0"],
                   env={"LOONGFORGE_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = proc.stdout
    assert "qwen3_vl_debug (" in out and re.search(r"2 samples x 40 tokens \(\d+ patches of images 32x32, 64x32\)", out)
    assert "baseline: transformers Qwen" in out and "first-step loss ours" in out and "agrees with hf_eager" in out


def test_bench_cases_and_sizes_fail_before_any_run(capsys, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_ACCELERATOR", "cpu")
    assert main(["bench", "--tiny", "--image-sizes", "32x32,64x32"]) == 2  # two lengths without --seq-tokens
    assert "give --seq-tokens" in capsys.readouterr().err
    assert main(["bench", "--tiny", "--image-sizes", "32x30"]) == 2
    assert "positive multiple of patch_size x spatial_merge_size" in capsys.readouterr().err
    assert main(["bench", "--tiny", "--image-sizes", "64x64", "--seq-tokens", "10"]) == 2
    assert "leaving" in capsys.readouterr().err
    assert main(["bench", "--case", "qwen2_5_vl_3b", "--config", "qwen3_vl_debug"]) == 2
    assert "the case names its config" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["qwen2_5_vl_3b", "qwen3_vl_8b"])
def test_shipped_cases_build_their_batch(name):
    """A shipped case's config composes, its images fit the encoder's patch grid, and every sample
    has the case's length (no model is built)."""
    import argparse

    import torch

    from loongforge.vlm.bench import CASES, load_config, make_batch, make_case
    from loongforge.vlm.recipe import VLMTask

    args = argparse.Namespace(case=name, config=None, tiny=False, samples=None, image_size=None, image_sizes=None,
                              text_tokens=None, seq_tokens=None, pack=None)
    case = make_case(args, torch.device("cpu"), "vlm_debug", [])
    cfg = load_config(case, [], "/tmp/unused", seq_length=1)
    assert cfg.train.precision == "bf16-pure"
    batch = make_batch(cfg, VLMTask(cfg).vision_ids, case)
    shipped = CASES[name]
    assert batch.length == shipped.seq_tokens and batch.tokens == shipped.samples * shipped.seq_tokens
    assert len({tuple(s["grid_thw"][0]) for s in batch.samples}) == len(shipped.image_sizes)


def test_bench_times_the_step_lf_vlm_train_takes(tmp_path, monkeypatch):
    """Ours in the bench is lf-vlm train's step: from the same config and seed, on lf-vlm train's
    first step, its first-step loss is the one the training run logs for step 1."""
    from loongforge.core.metrics import read_metrics
    from loongforge.core.parallel import destroy_parallel
    from loongforge.vlm.bench import our_step
    from loongforge.vlm.cli import load_vlm_config

    monkeypatch.setenv("LOONGFORGE_ACCELERATOR", "cpu")
    overrides = ["train.steps=1", "train.global_batch_size=4", "checkpoint.save=false"]
    assert main(["train", *overrides, f"log.run_dir={tmp_path / 'run'}"]) == 0
    logged = [r for r in read_metrics(tmp_path / "run") if r.get("step") == 1]
    step = our_step(load_vlm_config("vlm_debug", [*overrides, f"log.run_dir={tmp_path / 'bench'}"]))
    try:
        assert step() == logged[0]["loss"]
    finally:
        destroy_parallel()
