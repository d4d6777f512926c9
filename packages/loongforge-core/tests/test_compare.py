import argparse
import json

import pytest

from loongforge.core.cli import add_run_commands, run_main
from loongforge.core.compare import compare_runs, format_comparison


def _run(path, losses: dict[int, float], **extra):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": v, **extra}) + "\n" for s, v in losses.items()))
    return path


def _cli(*argv):
    parser = argparse.ArgumentParser()
    add_run_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compare", *map(str, argv)])
    return run_main(lambda: args.fn(args))


def test_window_means_over_common_steps(tmp_path):
    a = _run(tmp_path / "a", {s: float(s) for s in range(1, 8)})
    # B misses step 3 and logs an extra step 9; its losses are A's times 1.1, step 7 twice that
    b = _run(tmp_path / "b", {**{s: 1.1 * s for s in (1, 2, 4, 5, 6)}, 7: 2.2 * 7, 9: 1.0})
    result = compare_runs(a, b, window=2)
    assert [(w.first_step, w.last_step) for w in result.windows] == [(1, 2), (4, 5), (6, 7)]
    assert [w.mean_a for w in result.windows] == pytest.approx([1.5, 4.5, 6.5])
    assert [w.mean_b for w in result.windows] == pytest.approx([1.65, 4.95, (6.6 + 15.4) / 2])
    assert result.windows[0].relative == pytest.approx(0.1)
    worst = result.worst()
    assert (worst.first_step, worst.relative) == (6, pytest.approx(22.0 / 13.0 - 1))
    text = format_comparison(result, "a", "b", worst)
    assert "+10.00%" in text and "69.23% (steps 6-7)" in text


def test_a_short_tail_joins_the_last_window(tmp_path):
    a = _run(tmp_path / "a", {s: 1.0 for s in range(1, 22)})
    b = _run(tmp_path / "b", {**{s: 1.0 for s in range(1, 21)}, 21: 1.25})  # one noisy step at the end
    result = compare_runs(a, b, window=10)
    assert [(w.first_step, w.last_step) for w in result.windows] == [(1, 10), (11, 21)]
    assert result.worst().relative == pytest.approx(0.25 / 11)


def test_tolerance_judges_windows_from_the_given_step(tmp_path, capsys):
    a = _run(tmp_path / "a", {s: 2.0 for s in range(1, 21)})
    b = _run(tmp_path / "b", {s: 2.0 * (1.05 if s <= 10 else 1.005) for s in range(1, 21)})
    assert _cli(a, b, "--tolerance", "0.01") == 1  # steps 1-10 are 5% apart
    assert "more than 1.00% from A" in capsys.readouterr().err
    assert _cli(a, b, "--tolerance", "0.01", "--from-step", "11") == 0
    assert "0.50% (steps 11-20)" in capsys.readouterr().out
    assert _cli(a, b) == 0  # no tolerance: a report only


def test_a_diverged_run_is_the_worst_window_and_fails_any_tolerance(tmp_path, capsys):
    a = _run(tmp_path / "a", {s: 2.0 for s in range(1, 21)})
    b = _run(tmp_path / "b", {**{s: 2.0 * 1.2 for s in range(1, 11)}, **{s: 2.0 for s in range(11, 20)}, 20: float("nan")})
    worst = compare_runs(a, b).worst()
    assert worst.first_step == 11 and worst.distance == float("inf")  # NaN beats the 20% window
    assert _cli(a, b, "--tolerance", "10") == 1
    captured = capsys.readouterr()
    assert "   11-20       2.0000       nan  diverged (B: nan)\n" in captured.out
    assert "from step 1: diverged (B: nan) (steps 11-20)" in captured.out
    assert "+nan%" not in captured.out
    assert captured.err == "diverged (B: nan) in steps 11-20\n"
    assert _cli(a, b) == 0  # no tolerance: a report only
    assert "from step 1: diverged (B: nan) (steps 11-20)" in capsys.readouterr().out


def test_a_diverged_reference_run_is_named(tmp_path):
    a = _run(tmp_path / "a", {1: 2.0, 2: float("inf"), 3: float("nan")})
    b = _run(tmp_path / "b", {1: 8.0, 2: 2.0, 3: float("nan")})
    result = compare_runs(a, b, window=1)
    assert [w.difference("a", "b") for w in result.windows] == ["+300.00%", "diverged (a: inf)", "diverged (a: nan, b: nan)"]
    assert result.worst().first_step == 2  # inf beats the 300% window


def test_zero_means_compare_without_dividing_by_zero(tmp_path):
    a = _run(tmp_path / "a", {1: 0.0, 2: 0.0})
    b = _run(tmp_path / "b", {1: 0.0, 2: 1.0})
    assert [w.relative for w in compare_runs(a, a, window=1).windows] == [0.0, 0.0]
    assert [w.relative for w in compare_runs(a, b, window=1).windows] == [0.0, float("inf")]


@pytest.mark.parametrize(("case", "message"), [("missing", "metrics.jsonl: no such file"),
                                               ("no_key", "no record has the key 'loss'"),
                                               ("disjoint", "at no common step"),
                                               ("late_start", "no comparison window starts at or after step 50"),
                                               ("no_step", "metrics.jsonl:2: not a metrics record"),
                                               ("null_loss", "metrics.jsonl: step 2: loss=None is not a number"),
                                               ("bad_json", "metrics.jsonl:2: not a metrics record")])
def test_bad_runs_name_the_file_or_step(tmp_path, capsys, case, message):
    a = _run(tmp_path / "a", {s: 1.0 for s in range(1, 11)})
    if case == "missing":
        b = tmp_path / "nothing"
    elif case == "no_key":
        b = tmp_path / "b"
        b.mkdir()
        (b / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens_per_s": 5.0}) + "\n")
    elif case in ("no_step", "null_loss", "bad_json"):
        b = tmp_path / "b"
        b.mkdir()
        bad = {"no_step": '{"loss": 1.0}', "null_loss": '{"step": 2, "loss": null}', "bad_json": '{"step": 2, "lo'}[case]
        (b / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n" + bad + "\n")
    elif case == "disjoint":
        b = _run(tmp_path / "b", {s: 1.0 for s in range(11, 15)})
    else:
        b = _run(tmp_path / "b", {s: 1.0 for s in range(1, 11)})
    extra = ["--from-step", "50"] if case == "late_start" else []
    assert _cli(a, b, *extra) == 2
    err = capsys.readouterr().err
    assert message in err
    if case != "late_start":
        assert str(b) in err
