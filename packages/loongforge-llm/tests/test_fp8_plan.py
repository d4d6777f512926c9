"""fp8=adaptive's plan as a value: the choice from agreed times, its JSON (the checkpoint manifest's
``fp8_plan``), lookups, merging and the bench's table; measuring it with a fake timer; and the
refusal where no fused FP8 kernel runs (CPU). Agreement over ranks and resume are in
test_fp8_training.py."""

from __future__ import annotations

import json

import pytest

from loongforge.core.config import ConfigError
from loongforge.core.kernels import KernelPolicy
from loongforge.core.kernels.fp8_format import ALL_FP8, GEMMS, Fp8Gemms
from loongforge.llm.layers.fp8_measure import check_adaptive_fp8, fused_fp8_linear, measure_fp8_plan
from loongforge.llm.layers.fp8_plan import COMBINATIONS, FP8Plan, ShapePlan, fastest, label


def test_combinations_are_every_choice_fewest_fp8_first():
    assert len(set(COMBINATIONS)) == 8
    assert COMBINATIONS[0] == Fp8Gemms(False, False, False) and COMBINATIONS[-1] == ALL_FP8
    assert [len(g.names()) for g in COMBINATIONS] == sorted(len(g.names()) for g in COMBINATIONS)
    assert [label(g) for g in COMBINATIONS[:4]] == ["none", "fprop", "dgrad", "wgrad"]
    assert Fp8Gemms.from_names(["wgrad", "fprop"]) == Fp8Gemms(True, False, True)
    with pytest.raises(ValueError, match="each one of fprop, dgrad, wgrad"):
        Fp8Gemms.from_names(["fwd"])


def test_fastest_breaks_ties_towards_fewer_fp8_gemms():
    assert fastest([3, 2, 2, 5, 1, 1, 9, 9]) == Fp8Gemms.from_names(["fprop", "dgrad"])
    assert fastest([1.0] * 8) == Fp8Gemms(False, False, False)
    assert fastest([float("nan")] * 7 + [5.0]) == ALL_FP8  # a NaN time never wins
    with pytest.raises(ValueError, match="expected 8 times"):
        fastest([1.0, 2.0])


def _plan() -> FP8Plan:
    return FP8Plan((ShapePlan(256, 64, ALL_FP8, 512, tuple(float(8 - i) for i in range(8))),
                    ShapePlan(128, 64, Fp8Gemms(True, False, True), 512, (2.0, 1.0, 3.0, 4.0, 5.0, 0.5, 6.0, 7.0)),
                    ShapePlan(64, 128, Fp8Gemms(False, True, False))))  # given, not measured


def test_plan_round_trips_through_json():
    plan = _plan()
    record = json.loads(json.dumps(plan.to_dict()))  # what the manifest holds
    assert record["version"] == 1
    assert [s["out_features"] for s in record["shapes"]] == [64, 128, 256]  # sorted by shape
    assert record["shapes"][1]["fp8"] == ["fprop", "wgrad"]
    assert record["shapes"][1]["ms"]["fprop+wgrad"] == 0.5 and "ms" not in record["shapes"][0]
    assert FP8Plan.from_dict(record) == plan


@pytest.mark.parametrize("record", [
    None, {"shapes": []}, {"version": 2, "shapes": []}, {"version": 1, "shapes": [{"out_features": 4}]},
    {"version": 1, "shapes": [{"out_features": 4, "in_features": 4, "fp8": ["fast"]}]},
])
def test_malformed_plans_are_refused(record):
    with pytest.raises(ValueError, match="fp8_plan"):
        FP8Plan.from_dict(record)


def test_lookups_missing_shapes_and_merging():
    plan = _plan()
    assert plan.gemms(128, 64) == Fp8Gemms(True, False, True)
    with pytest.raises(LookupError, match=r"no entry for a linear of weight 64x64 \(has: 64x128, 128x64, 256x64\)"):
        plan.gemms(64, 64)
    assert plan.missing([(64, 64), (128, 64), (32, 16), (64, 64)]) == [(32, 16), (64, 64)]
    other = FP8Plan((ShapePlan(64, 64, ALL_FP8), ShapePlan(128, 64, Fp8Gemms(False, False, False))))
    merged = plan.merged(other)
    assert merged.gemms(64, 64) == ALL_FP8 and merged.gemms(128, 64) == Fp8Gemms(True, False, True)  # its own wins
    with pytest.raises(ValueError, match="appears twice"):
        FP8Plan((ShapePlan(1, 2, ALL_FP8), ShapePlan(1, 2, ALL_FP8)))


def test_table_lists_each_shape_its_times_and_choice():
    header, *rows = _plan().table().splitlines()
    assert header.split()[:3] == ["out", "in", "tokens"] and header.split()[3:11] == [
        "none", "f", "d", "w", "fd", "fw", "dw", "fdw"]
    assert [r.split()[0] for r in rows] == ["64", "128", "256"]
    assert rows[0].split()[2:12] == ["-"] * 9 + ["dgrad"]  # given: no times
    assert rows[1].split()[11:] == ["fprop+wgrad", "4.00x", "14.00x"]  # 2.0 / 0.5, 7.0 / 0.5


def test_measure_times_every_shape_in_every_combination():
    calls = []

    def timer(tokens, out_features, in_features, gemms):
        calls.append((tokens, out_features, in_features, gemms))
        return 10.0 - len(gemms.names()) + (5.0 if gemms.dgrad and out_features < 100 else 0.0)

    plan = measure_fp8_plan([(64, 32), (256, 64)], 1024, timer)  # no process group: nothing distributed
    assert len(calls) == 16 and {c[0] for c in calls} == {1024}
    assert [c[3] for c in calls[:8]] == list(COMBINATIONS)
    assert plan.gemms(64, 32) == Fp8Gemms(True, False, True)  # dgrad in FP8 is slow at this shape
    assert plan.gemms(256, 64) == ALL_FP8
    assert plan.shapes[0].tokens == 1024 and plan.shapes[0].ms[-1] == 12.0


def test_adaptive_is_refused_where_fp8_linear_is_the_reference():
    """On CPU (and with the references forced anywhere) the op is the torch reference: no FP8 GEMM to time."""
    assert not fused_fp8_linear(KernelPolicy(force_reference=True))
    with pytest.raises(ConfigError, match="fp8=adaptive: fp8_linear runs its torch reference here"):
        check_adaptive_fp8(KernelPolicy(force_reference=True))
    assert tuple(GEMMS) == ("fprop", "dgrad", "wgrad")
