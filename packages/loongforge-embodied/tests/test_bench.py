"""``lf-embodied bench``: LeRobot's recipe is the one its training script runs on a GPU, both sides
start from the same weights (their first-step losses agree), the runs alternate order, and
``--variant`` adds runs of ours (tiny sizes on CPU; no timing assertions)."""

from __future__ import annotations

import math

import pytest
import torch

from lerobot_reference import build_lerobot_pi05
from loongforge.core.bench_protocol import bench_world
from loongforge.embodied.bench import build_lerobot_pi05_released, lerobot_recipe, load_runs, run_bench


def test_lerobot_recipe_is_its_gpu_training_recipe():
    recipe = lerobot_recipe()
    assert dict(recipe.options) == {"dtype": "bfloat16", "autocast": "bfloat16", "tf32": True, "compile_model": True,
                                    "compile_mode": "max-autotune", "fused_adamw": True, "grad_clip_norm": 1.0,
                                    "gradient_checkpointing": False}
    assert recipe.applied("cuda") == dict(recipe.options)
    on_cpu = recipe.applied("cpu")  # requested, applied on CUDA only
    assert (on_cpu["tf32"], on_cpu["fused_adamw"], on_cpu["compile_model"], on_cpu["autocast"]) == (False, False, False, None)
    lines = "\n".join(recipe.lines("cpu"))
    assert "compile_model = True  (requested; CUDA only, not applied on cpu)" in lines
    assert "grad_clip_norm = 1.0\n" in lines + "\n"
    assert "--lerobot-compile-mode" not in lines


def test_lerobot_compile_mode_is_marked_as_a_departure_from_its_default():
    recipe = lerobot_recipe("default")
    assert recipe.applied("cuda")["compile_mode"] == "default" and recipe.applied("cpu")["compile_mode"] is None
    lines = "\n".join(recipe.lines("cuda"))
    assert "compile_mode = default\n" in lines
    assert "compile_mode 'default' set by --lerobot-compile-mode: LeRobot's default is 'max-autotune'" in lines


def test_lerobot_uncompiled_is_pi05_configs_default():
    recipe = lerobot_recipe("none")
    applied = recipe.applied("cuda")
    assert (applied["compile_model"], applied["compile_mode"]) == (False, None)
    assert (applied["tf32"], applied["fused_adamw"], applied["autocast"]) == (True, True, "bfloat16")
    assert "compile_model = False set by --lerobot-compile-mode none" in "\n".join(recipe.lines("cuda"))


def _tiny(cfg, recipe, device_type):
    return build_lerobot_pi05(cfg)


def test_both_sides_same_weights_first_losses_agree_and_order_alternates():
    cfgs = load_runs(None, ["model.image_size=16", "model.chunk_size=4", "model.max_token_len=12"],
                     ["full=train.recompute=full"], batch_size=2)
    lines = []
    with bench_world(seed=0) as ctx:
        results = run_bench(cfgs, ctx, steps=2, warmup=1, rounds=2, against_lerobot=True, build_baseline=_tiny,
                            report=lines.append)
    out = "\n".join(lines)
    assert list(results) == ["lerobot", "ours", "full"]
    assert all(math.isfinite(r.samples_per_s) and r.samples_per_s > 0 for r in results.values())
    ref = results["lerobot"].first_loss
    assert [r.first_loss for r in results.values()] == pytest.approx([ref] * 3, rel=1e-4)
    assert "first-step loss ours" in out and "DISAGREES" not in out
    assert "round 1 of 2: lerobot, ours, full" in out and "round 2 of 2: ours, full, lerobot" in out
    assert "baseline: LeRobot PI05Pytorch" in out and "tf32 = True  (requested" in out
    with pytest.raises(ValueError, match="pi05_base"):
        build_lerobot_pi05_released(cfgs["ours"].model)


def test_bench_times_the_step_lf_embodied_train_takes(tmp_path):
    """Ours in the bench is lf-embodied train's step: from the same config, seed and data its
    first-step loss is the one the training run logs for step 1, to the last bit."""
    from loongforge.core.metrics import read_metrics
    from loongforge.embodied.cli import main

    overrides = ["train.global_batch_size=2", "model.image_size=16", "model.chunk_size=4", "model.max_token_len=12"]
    assert main(["train", *overrides, "train.steps=1", f"log.run_dir={tmp_path / 'run'}", "checkpoint.save=false"]) == 0
    logged = [r for r in read_metrics(tmp_path / "run") if r.get("step") == 1]
    with bench_world(seed=1234) as ctx:
        results = run_bench(load_runs(None, overrides, []), ctx, steps=1, warmup=1, rounds=1, report=lambda line: None)
    assert results["ours"].first_loss == logged[0]["loss"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--variant", "lerobot_x=train.recompute=full"], "not starting with lerobot"),
    (["--variant", "ours=train.recompute=full"], "give it a name of its own"),
    (["--variant", "v=model.chunk_size=5"], "a variant changes train.* only"),
    (["--variant", "v=train.recompte=full"], "recompte"),
    (["--rounds", "0"], "at least one round"),
    (["--against-lerobot", "--lerobot-compile-mode", "fast"], "--lerobot-compile-mode 'fast': one of max-autotune"),
    (["--lerobot-compile-mode", "default"], "it needs --against-lerobot"),
])
def test_bench_bad_variants_fail_before_any_run(argv, message, capsys):
    from loongforge.embodied.cli import main

    assert main(["bench", "--steps", "1", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "ms/step" not in captured.out


def test_bench_command_runs_ours_and_a_variant():
    from cli_runner import run_cli

    proc = run_cli(["lf-embodied", "bench", "--batch-size", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
                    "--variant", "full=train.recompute=full"], env={"LOONGFORGE_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    header, *rows = [line for line in proc.stdout.splitlines() if line.startswith(("run ", "ours ", "full "))]
    assert header.split()[:5] == ["run", "samples/s", "ms/step", "peak", "GiB"]
    assert [r.split()[0] for r in rows] == ["ours", "full"]
    assert "first-step loss full" in proc.stdout and "agrees with ours" in proc.stdout
    # MFU from the FLOPs torch counts in one step: the same model FLOPs for both runs (recomputation is not counted)
    assert header.split()[-2:] == ["TFLOP/s", "MFU"] and "model FLOPs: " in proc.stdout
    import json

    runs = json.loads(proc.stdout[proc.stdout.index("\n{") + 1 :])
    flops = [r["tflops"] * r["step_s"] for r in runs.values()]
    assert all(f > 0 for f in flops) and flops[0] == pytest.approx(flops[1], rel=1e-9)
