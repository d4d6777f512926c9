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
    assert "2 samples x" in proc.stdout and "32px image" in proc.stdout
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
