"""`lf-llm` end to end: the default run learns, bad configs fail before any process group."""

import json
import math

import pytest

import torch.distributed as dist
from cli_runner import run_cli

from loongforge.llm.cli import main


def test_unknown_key_fails_before_process_group(capsys):
    rc = main(["train", "train.no_such_key=1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == "error: unknown key 'train.no_such_key'"  # an override: no file to name
    assert not dist.is_initialized()


def test_bad_value_names_key(capsys):
    rc = main(["train", "train.global_batch_size=7", "train.micro_batch_size=2"])
    assert rc == 2
    assert "train.global_batch_size=7" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_default_train_loss_falls(tmp_path, llm_data_cache):
    proc = run_cli(["lf-llm", "train", "train.steps=30", f"log.run_dir={tmp_path}", f"data.cache_dir={llm_data_cache}",
                    "log.interval=1", "log.tensorboard=false"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[-1]["loss"] < records[0]["loss"] - 1.5
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in records)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    # train_debug: lr 3e-3, min_lr 3e-4, 5 warm-up steps (the first at lr/5), cosine to step 30: the
    # loop's one schedule, the same in every lf-* CLI
    lr, min_lr, warmup, steps = 3e-3, 3e-4, 5, 30

    def expected(k: int) -> float:
        n = k - 1  # the 0-based step
        if n < warmup:
            return lr * (n + 1) / warmup
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (n - warmup) / (steps - warmup)))

    assert [r["lr"] for r in records] == pytest.approx([expected(k) for k in range(1, 31)], rel=1e-9, abs=1e-15)

    # `lf-llm compare`: the run against a copy whose loss is 3% higher from step 21 on
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "loss": r["loss"] * (1.03 if r["step"] > 20 else 1.0)}) + "\n" for r in records))
    proc = run_cli(["lf-llm", "compare", str(tmp_path), str(other), "--tolerance", "0.01"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "+0.00%" in proc.stdout and "+3.00%" in proc.stdout
    assert "3.00% (steps 21-30)" in proc.stdout
