"""Qwen3.5 end to end: `lf-llm train --config qwen3_5_debug` (the hybrid debug model on the
bundled corpus, on CPU: the DeltaNet's torch reference) learns and checkpoints; a Gated DeltaNet
layer under context parallelism (processes on gloo) equals the same layer in one process."""

import json

import pytest
from cli_runner import run_cli


@pytest.mark.slow  # one CLI run, ~15 s alone (the DeltaNet reference runs in chunks)
def test_qwen3_5_debug_trains(tmp_path, llm_data_cache):
    proc = run_cli(["lf-llm", "train", "--config", "qwen3_5_debug", "train.steps=8", "train.global_batch_size=4",
                    "train.micro_batch_size=4", "train.warmup_steps=2", f"log.run_dir={tmp_path}",
                    f"data.cache_dir={llm_data_cache}", "log.interval=1", "log.tensorboard=false"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "qwen3_5 on cpu" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000008"


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=pytest.mark.long)])
def test_delta_net_context_parallel_equals_one_process(cp):
    """A Gated DeltaNet layer under CP (gloo, sequential state passing) gives each rank the output
    rows, input gradients and (summed) parameter gradients of the whole sequences run in one
    process, for dense rows and for a packed row (one sequence's chunks shorter than the
    convolution's reach)."""
    from pathlib import Path

    from cli_runner import run_script

    proc = run_script(Path(__file__).parent / "gdn_cp_probe.py", [str(cp)], nproc=cp)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout.count("ok") == cp
