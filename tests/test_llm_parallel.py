"""TP=2, PP=2, CP=2, DP=2 and the distributed optimizer give the losses of one process (gloo, cpu)."""

import json

import pytest
from cli_runner import run_cli

STEPS = 3
COMMON = [
    f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
    "train.warmup_steps=1", "log.interval=1", "log.progress=false", "log.tensorboard=false",
]


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir, data_cache, extra, nproc=1):
    proc = run_cli(["lf-llm", "train", *COMMON, f"log.run_dir={run_dir}", f"data.cache_dir={data_cache}", *extra], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return losses(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, llm_data_cache):
    run = tmp_path_factory.mktemp("ref")
    ref = train(run, llm_data_cache, ["checkpoint.interval=1", f"checkpoint.keep_last={STEPS}"])
    assert len(ref) == STEPS
    return run, ref


# plain dp2 runs with -m long: dp2-distopt goes through the same data-parallel split and gradient
# all-reduce (then shards the optimizer), within CI's time budget
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.cp=2"], ["train.use_distributed_optimizer=true"],
                                    pytest.param([], marks=pytest.mark.long)],
                         ids=["tp2", "cp2", "dp2-distopt", "dp2"])
def test_layout_matches_one_process(layout, reference, tmp_path, llm_data_cache):
    _, ref = reference
    got = train(tmp_path, llm_data_cache, ["checkpoint.save=false", *layout], nproc=2)
    assert got == pytest.approx(ref, rel=1e-4)


def test_pp2_from_same_weights_matches_one_process(reference, tmp_path, llm_data_cache):
    """PP stages initialise their layers differently, so start PP=2 from the 1-process step-1
    checkpoint (resharded on load) and compare steps 2..3."""
    ref_run, ref = reference
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "step_00000001").symlink_to(ref_run / "checkpoints" / "step_00000001")
    (ckpt / "latest").write_text("step_00000001\n")
    got = train(tmp_path, llm_data_cache, ["parallel.pp=2", "checkpoint.save=false"], nproc=2)
    assert got == pytest.approx(ref[1:], rel=1e-4)
