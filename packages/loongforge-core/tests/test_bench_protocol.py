"""What every ``lf-* bench`` shares against its baseline: the recipe printout, the first-step loss
check, the alternating order, the spread over processes and the spec peaks for MFU."""

import pytest
import torch

from loongforge.core.baseline_recipe import BaselineRecipe, tf32_matmuls
from loongforge.core.bench_protocol import (FirstLossMismatch, alternating_orders, check_first_losses,
                                            first_loss_tolerance, in_fresh_processes, spread, spread_lines,
                                            timed_steps)
from loongforge.core.device_peaks import spec_peak_bf16


def test_recipe_marks_cuda_only_options_as_requested_elsewhere():
    recipe = BaselineRecipe("proj", "its script", {"compile": True, "fused_adamw": True, "attn": "flash"},
                            cuda_only=frozenset({"fused_adamw", "attn"}), notes=("a note",))
    assert recipe["compile"] is True
    assert recipe.applied("cuda") == {"compile": True, "fused_adamw": True, "attn": "flash"}
    assert recipe.applied("cpu") == {"compile": True, "fused_adamw": False, "attn": None}
    lines = recipe.lines("cpu")
    assert lines[0] == "baseline: proj (its script)"
    assert "  fused_adamw = True  (requested; CUDA only, not applied on cpu)" in lines
    assert "  compile = True" in lines and lines[-1] == "  a note"


def test_tf32_matmuls_restores_the_previous_setting():
    before = torch.backends.cuda.matmul.allow_tf32
    with tf32_matmuls(not before):
        assert torch.backends.cuda.matmul.allow_tf32 is (not before)
    assert torch.backends.cuda.matmul.allow_tf32 is before


def test_first_loss_check_passes_within_tolerance_and_fails_loudly_beyond():
    assert first_loss_tolerance(torch.float32) == 1e-4 and first_loss_tolerance(torch.bfloat16) == 5e-2
    assert first_loss_tolerance(torch.float32, fp8=True) == 5e-2
    lines = check_first_losses({"base": 2.0, "ours": 2.0001}, "base", torch.float32)
    assert len(lines) == 2 and "agrees with base" in lines[1]
    with pytest.raises(FirstLossMismatch, match="ours 2.010000"):
        check_first_losses({"base": 2.0, "ours": 2.01, "v": 2.0}, "base", torch.float32)
    check_first_losses({"base": 2.0, "ours": 2.05}, "base", torch.bfloat16)  # 2.5% in bf16: agrees
    with pytest.raises(FirstLossMismatch):
        check_first_losses({"base": 2.0, "ours": float("nan")}, "base", torch.bfloat16)
    check_first_losses({"base": 2.0, "fp8": 2.05}, "base", torch.float32, fp8_runs=["fp8"])


def test_orders_alternate_baseline_first_then_ours_first():
    assert alternating_orders(["b1", "b2"], ["ours", "v"], 3) == [
        ["b1", "b2", "ours", "v"], ["ours", "v", "b1", "b2"], ["b1", "b2", "ours", "v"]]
    with pytest.raises(ValueError):
        alternating_orders(["b"], ["ours"], 0)


def test_timed_steps_returns_the_first_loss_and_one_time_per_timed_step():
    calls = []

    def step():
        calls.append(1)
        return torch.tensor(3.0 - len(calls))

    first, times, last = timed_steps(step, steps=4, warmup=2, synchronize=lambda: None)
    assert first == 2.0 and len(times) == 4 and len(calls) == 6 and last == -3.0


def test_run_rounds_alternates_builds_afresh_and_leaves_out_a_failing_baseline():
    """Each round builds every side afresh and releases it; a side measured elsewhere gives its own
    times; a baseline allowed to fail is reported and left out, ours failing raises."""
    from loongforge.core.bench_protocol import Measured, Side, run_rounds

    events = []

    def start(name, losses):
        def begin():
            events.append(f"start {name}")
            values = iter(losses)
            return (lambda: torch.tensor(next(values))), (lambda: events.append(f"release {name}"))
        return begin

    def broken():
        raise RuntimeError("this version cannot run it")

    elsewhere = lambda steps, warmup: Measured(5.0, [0.5] * steps, 4.0, float("nan"))  # noqa: E731
    lines = []
    sides = [Side("base", start("base", [2.0, 1.9, 1.8, 1.7] * 2)), Side("broken", broken, may_fail=True),
             Side("fresh", measure=elsewhere), Side("ours", start("ours", [2.0, 1.5, 1.2, 1.0] * 2))]
    out = run_rounds(sides, ["base", "broken", "fresh"], rounds=2, steps=2, warmup=2, report=lines.append)
    assert list(out) == ["base", "fresh", "ours"]  # the failing baseline is left out
    assert lines[0] == "round 1 of 2: base, broken, fresh, ours" and "round 2 of 2: ours, base, fresh" in lines
    assert any(line == "  broken: failed: RuntimeError: this version cannot run it" for line in lines)
    assert events == ["start base", "release base", "start ours", "release ours"] * 1 + [
        "start ours", "release ours", "start base", "release base"]
    assert out["ours"].first_loss == 2.0 and len(out["ours"].seconds) == 4 and out["ours"].last_loss == 1.0
    assert out["fresh"].first_loss == 5.0 and out["fresh"].seconds == [0.5] * 4 and out["fresh"].last_loss == 4.0
    with pytest.raises(RuntimeError, match="cannot run"):
        run_rounds([Side("ours", broken)], [], rounds=1, steps=1, warmup=1, report=lines.append)
    with pytest.raises(ValueError, match="start or measure"):
        Side("both", broken, measure=elsewhere)


def test_spread_lines_give_median_spread_and_ratio_over_the_baseline():
    per_process = [{"base": 0.2, "ours": 0.1}, {"base": 0.3, "ours": 0.1}, {"base": 0.25, "ours": 0.12}]
    assert spread([0.2, 0.3, 0.25]) == pytest.approx(0.4)
    header, base, ours = spread_lines(per_process, ["base"])
    assert header.split()[:5] == ["run", "median", "ms", "min", "max"]
    assert base.split()[1:5] == ["250.0", "200.0", "300.0", "40.0%"] and base.split()[-1] == "1.00"
    assert ours.split()[-1] == "2.50"


@pytest.mark.slow
def test_in_fresh_processes_returns_each_process_result():
    lines = []
    # the target must be importable in a spawned process: ``dict`` returns its keyword arguments
    out = in_fresh_processes(dict, {"base": 1.0, "ours": 0.5}, 2, report=lines.append)
    assert out == [{"base": 1.0, "ours": 0.5}] * 2
    assert lines == ["-- process 1 of 2", "-- process 2 of 2"]


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H20", 148e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("Some GPU", None),
])
def test_spec_peaks_by_device_name(name, peak):
    assert spec_peak_bf16(name) == peak
