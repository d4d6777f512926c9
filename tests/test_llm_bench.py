"""``lf-llm bench`` on CPU: the smoke run of the GPU benchmark (fp32, the debug model)."""

import re

import pytest
from cli_runner import run_cli

from loongforge.llm.cli import main


def test_bench_runs_ours_variant_and_hf_baseline():
    proc = run_cli(["lf-llm", "bench", "--config", "train_debug", "--steps", "2", "--warmup", "1",
                    "--variant", "selective=train.recompute=selective", "train.global_batch_size=4",
                    "train.micro_batch_size=2"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = proc.stdout
    assert "512 tokens/step (train_debug)" in out  # global batch 4 x 128 tokens
    per_run = dict(re.findall(r"^(\w+): [\d.]+ ms/step, ([\d,]+) tokens/s", out, flags=re.M))
    assert set(per_run) == {"ours", "selective", "hf_sdpa"}
    assert all(int(v.replace(",", "")) > 0 for v in per_run.values())
    assert "hf_sdpa_compile: skipped" in out
    header, *rows = out[out.index("\nrun ") + 1 :].strip().splitlines()
    assert header.split()[-1] == "hf_sdpa" and [r.split()[0] for r in rows] == ["ours", "selective", "hf_sdpa"]
    assert rows[-1].split()[-1] == "1.00"  # the baseline against itself


@pytest.mark.parametrize(("argv", "message"), [
    (["--variant", "ours=train.lr=1"], "give it a name of its own"),
    (["--variant", "x=train.lr"], "'train.lr' is not of the form key=value"),
    (["--config", "train_qwen3_moe_debug"], "model.family='qwen3_moe' is not 'llama'"),
    (["train.stepz=3"], "stepz"),
])
def test_bench_bad_arguments_fail_before_any_run(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
