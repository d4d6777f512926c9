"""The parts of ``loongforge.core.benchmarking`` that every ``lf-* bench`` shares: the ``--variant``
syntax and the final table of the runs against the baselines."""

import math

import pytest

from loongforge.core.benchmarking import (ExtraColumn, RunResult, check_timing, parse_variant, results_table,
                                          split_items)
from loongforge.core.config import ConfigError


@pytest.mark.parametrize(("text", "items"), [
    ("", []),
    ("a=1", ["a=1"]),
    ("a=1,b=2", ["a=1", "b=2"]),
    ("a.b=[1,2],c=3", ["a.b=[1,2]", "c=3"]),
    ("a=[[1,2],[3]],b={x: 1, y: [2,3]}", ["a=[[1,2],[3]]", "b={x: 1, y: [2,3]}"]),
    ('train.x="a,b",y=\'c,[d\'', ['train.x="a,b"', "y='c,[d'"]),
    ("a=(1,2),b=2", ["a=(1,2)", "b=2"]),
    ("a=1,,b=2,", ["a=1", "", "b=2", ""]),  # empty items are kept, for the caller to reject
])
def test_split_items_keeps_bracketed_and_quoted_commas(text, items):
    assert split_items(text) == items


@pytest.mark.parametrize(("text", "message"), [
    ("a=[1,2", "']' is missing at the end"),
    ("a={x: [1}", "'}' closes no open bracket"),
    ("a=1]", "']' closes no open bracket"),
    ('a="x,y', """'"' is missing at the end"""),
])
def test_split_items_rejects_unbalanced_brackets_and_quotes(text, message):
    with pytest.raises(ValueError, match=message):
        split_items(text)


def test_parse_variant_name_and_list_valued_items():
    assert parse_variant("v=a.b=[1,2],c=3", ["ours"]) == ("v", ["a.b=[1,2]", "c=3"])
    assert parse_variant('v=train.x="a,b"', []) == ("v", ['train.x="a,b"'])
    assert parse_variant("v=x=a=b", []) == ("v", ["x=a=b"])  # the value may hold '='
    assert parse_variant("plain", ["ours"]) == ("plain", [])  # a repeat of ours under another name
    assert parse_variant("plain=", ["ours"]) == ("plain", [])


@pytest.mark.parametrize(("spec", "taken", "message"), [
    ("=a=1", [], "give it a name of its own"),
    ("ours=a=1", ["ours"], "'ours' names an earlier run"),
    ("hf_x=a=1", [], "not starting with hf_"),
    ("hf_sdpa=a=1", ["hf_sdpa"], "not starting with hf_"),  # the prefix, before the name's use
    ("v=a=1,b", [], "item 'b' is not of the form key=value"),
    ("v=a=1,,b=2", [], "item '' is not of the form key=value"),
    ("v=a=[1,2", [], "']' is missing at the end"),
])
def test_parse_variant_errors_name_the_spec(spec, taken, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_variant(spec, taken)
    assert str(info.value).startswith(f"--variant {spec!r}: ")


def test_parse_variant_reserved_prefix_is_the_callers():
    with pytest.raises(ConfigError, match="not starting with base_"):
        parse_variant("base_1=a=1", [], reserved_prefix="base_")
    assert parse_variant("hf_x=a=1", [], reserved_prefix="base_") == ("hf_x", ["a=1"])


def test_check_timing():
    check_timing(1, 0)
    for steps, warmup in ((0, 3), (5, -1)):
        with pytest.raises(ConfigError, match=f"--steps {steps} --warmup {warmup}: at least one timed step"):
            check_timing(steps, warmup)


RESULTS = {
    "ours": RunResult(tokens_per_s=150_379.4, tflops=445.123, mfu=0.6, peak_gib=14.24),
    "variant": RunResult(tokens_per_s=75_189.7, tflops=222.5, mfu=0.3, peak_gib=float("nan")),
    "hf_sdpa": RunResult(tokens_per_s=127_093.0, tflops=376.0, mfu=0.507, peak_gib=19.7),
    "hf_sdpa_compile": RunResult(tokens_per_s=129_697.0, tflops=384.0, mfu=0.517, peak_gib=14.4),
}


def test_results_table_rows_and_ratio_columns():
    header, *rows = results_table(RESULTS)
    assert header.split() == ["run", "tokens/s", "TFLOP/s", "MFU", "peak", "GiB", "x", "hf_sdpa", "x",
                              "hf_sdpa_compile"]
    assert len(header) == 22 + 12 + 10 + 8 + 10 + 2 * 18  # fixed-width columns
    assert rows[0] == (f"{'ours':<22}{'150,379':>12}{'445.12':>10}{'60.0%':>8}{'14.2':>10}"
                       f"{'1.18':>18}{'1.16':>18}")
    assert rows[1].split() == ["variant", "75,190", "222.50", "30.0%", "nan", "0.59", "0.58"]
    assert [r.split()[0] for r in rows] == list(RESULTS)
    assert rows[2].split()[-2] == "1.00" and rows[3].split()[-1] == "1.00"  # each baseline against itself


def test_results_table_without_baselines_has_no_ratio_column():
    header, row = results_table({"ours": RESULTS["ours"]})
    assert header.split()[-2:] == ["peak", "GiB"] and len(row.split()) == 5


def test_results_table_extra_column_and_decimals():
    losses = ExtraColumn("loss@1", {"ours": 10.37654321, "hf_sdpa": 10.3766})
    results = {"ours": RESULTS["ours"], "hf_sdpa": RESULTS["hf_sdpa"]}
    header, ours, hf = results_table(results, tokens_decimals=1, extra=[losses])
    assert header.split()[6:] == ["loss@1", "x", "hf_sdpa"]
    assert ours.split() == ["ours", "150,379.4", "445.12", "60.0%", "14.2", "10.3765", "1.18"]
    assert hf[22 + 12 + 10 + 8 + 10:][:9] == "  10.3766"  # the column's width after peak GiB
    assert math.isclose(float(hf.split()[-1]), 1.0)


def test_results_table_baselines_by_prefix():
    results = {"ours": RESULTS["ours"], "base": RESULTS["hf_sdpa"]}
    header, ours, _ = results_table(results, baseline_prefix="base")
    assert header.split()[-2:] == ["x", "base"] and ours.split()[-1] == "1.18"


def test_counted_flops_of_a_linear_training_step_are_six_m_n_k():
    """One forward and backward of ``x @ w`` (M x K by K x N): 2MNK forward, 2MNK for each of the
    input's and the weight's gradients."""
    import torch

    from loongforge.core.benchmarking import counted_flops

    m, k, n = 8, 16, 4
    x, w = torch.randn(m, k, requires_grad=True), torch.randn(k, n, requires_grad=True)
    assert counted_flops(lambda: (x @ w).sum().backward()) == 6 * m * n * k
