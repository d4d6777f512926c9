"""`lf-llm train` with recipe=sft: the shipped config end to end, and DP=2 with the load balancer
(gloo, CPU): each rank trains only its planned conversations, an epoch covers every conversation
exactly once, the losses are those of one process on the same global batches, resume is exact,
and PP=2 (padded packed rows, a varying number of micro-batches) continues the same run."""

import json

import pytest
from cli_runner import run_cli

from loongforge.llm.data.sft import bundled_sft_path

CONVERSATIONS, GLOBAL_BATCH = 40, 8
STEPS = CONVERSATIONS // GLOBAL_BATCH  # one epoch
COMMON = [
    "--config", "sft_debug", f"train.steps={STEPS}", f"train.global_batch_size={GLOBAL_BATCH}", "train.warmup_steps=1",
    "train.precision=fp32", "log.interval=1", "log.progress=false", "log.tensorboard=false", "log.sample_ids=true",
]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sample_ids(run_dir, dp_rank) -> dict[int, list[int]]:
    lines = (run_dir / "sample_ids" / f"dp_rank_{dp_rank}.jsonl").read_text().splitlines()
    return {r["step"]: r["ids"] for r in map(json.loads, lines)}


def train(run_dir, data, extra=(), nproc=1):
    proc = run_cli(["lf-llm", "train", *COMMON, f"log.run_dir={run_dir}", f"data.cache_dir={data.parent / 'cache'}",
                    f"sft.files=[{data}]", *extra], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return records(run_dir)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft-data") / "chats.jsonl"
    path.write_text("".join(bundled_sft_path().read_text().splitlines(keepends=True)[:CONVERSATIONS]))
    return path


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, chats):
    run = tmp_path_factory.mktemp("dp2")
    recs = train(run, chats, ["checkpoint.interval=2", f"checkpoint.keep_last={STEPS}"], nproc=2)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    return run, recs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, chats):
    run = tmp_path_factory.mktemp("one")
    return run, train(run, chats, ["checkpoint.save=false"])


def test_dp2_epoch_trains_every_conversation_once(dp2):
    run, recs = dp2
    ranks = [sample_ids(run, r) for r in range(2)]
    seen = []
    for step in range(1, STEPS + 1):
        a, b = ranks[0][step], ranks[1][step]
        assert a and b and not set(a) & set(b)  # each rank its own share of the step
        seen += a + b
    assert sorted(seen) == list(range(CONVERSATIONS))  # the epoch: every conversation exactly once
    for r in recs:  # a step either keeps the plain split (same imbalance) or improves on it
        before, after = r["balance/imbalance_before"], r["balance/imbalance_after"]
        assert after <= before if r["balance/rebalanced"] else after == before
    assert any(r["balance/rebalanced"] and r["balance/imbalance_after"] < r["balance/imbalance_before"] for r in recs)


def test_dp2_losses_match_one_process(dp2, one_process):
    (run2, recs2), (run1, recs1) = dp2, one_process
    assert [r["loss"] for r in recs2] == pytest.approx([r["loss"] for r in recs1], rel=1e-5)
    ranks, alone = [sample_ids(run2, r) for r in range(2)], sample_ids(run1, 0)
    for step in range(1, STEPS + 1):  # the same global batch, split differently
        assert sorted(ranks[0][step] + ranks[1][step]) == sorted(alone[step])
    assert all(r["balance/imbalance_before"] == 1.0 for r in recs1)  # one rank: nothing to balance


def _resume_from(run, step, into):
    """A run directory whose checkpoints hold ``run``'s checkpoint of ``step`` as the latest."""
    ckpt = into / "checkpoints"
    ckpt.mkdir(parents=True)
    name = f"step_{step:08d}"
    (ckpt / name).symlink_to(run / "checkpoints" / name)
    (ckpt / "latest").write_text(name + "\n")
    return into


def test_resume_replays_the_same_plan(dp2, tmp_path, chats):
    run, recs = dp2
    resumed = _resume_from(run, 2, tmp_path / "resumed")
    got = train(resumed, chats, ["checkpoint.save=false"], nproc=2)
    assert [r["step"] for r in got] == list(range(3, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in recs[2:]]  # bitwise on CPU, fp32
    for rank in range(2):
        want = sample_ids(run, rank)
        assert sample_ids(resumed, rank) == {s: want[s] for s in range(3, STEPS + 1)}


@pytest.mark.long  # (the default tier's budget: test_llm_resume reshards a TP2 checkpoint to PP2)
def test_pp2_continues_the_dp2_run(dp2, tmp_path, chats):
    """PP=2 (packed rows padded to seq_length, the step's micro-batches through the pipeline)
    from the DP=2 step-2 checkpoint (resharded on load) gives the DP=2 losses of steps 3.."""
    run, recs = dp2
    got = train(_resume_from(run, 2, tmp_path / "pp2"), chats, ["parallel.pp=2", "checkpoint.save=false"], nproc=2)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in recs[2:]], rel=1e-5)


def test_sft_debug_end_to_end(tmp_path, llm_data_cache):
    proc = run_cli(["lf-llm", "train", "--config", "sft_debug", "train.steps=20", f"log.run_dir={tmp_path}",
                    f"data.cache_dir={llm_data_cache}", "log.interval=1", "log.tensorboard=false"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "SFT data: 512 conversations" in proc.stdout
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 21))
    assert recs[-1]["loss"] < recs[0]["loss"] - 2.0
    assert all(r["tokens_per_s"] > 0 and "balance/imbalance_after" in r for r in recs)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000020"


@pytest.mark.parametrize("override, message", [
    ("train.micro_batch_size=2", "train.micro_batch_size=2: recipe=sft plans its micro-batches by tokens"),
    ("balance.token_cap=100", "balance.token_cap=100 is below train.seq_length=256"),
    ("sft.truncation=cut", "sft.truncation='cut': one of truncate, drop, error"),
    ("recipe=finetune", "recipe='finetune': one of pretrain, sft"),
    ("balance.coefficients=[1,2]", "balance.coefficients=[1.0, 2.0]: three numbers"),
])
def test_bad_sft_config_fails_before_process_group(capsys, override, message):
    import torch.distributed as dist

    from loongforge.llm.cli import main

    assert main(["train", "--config", "sft_debug", override]) == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()
