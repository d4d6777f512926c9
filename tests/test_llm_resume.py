"""Exact resume of `lf-llm train`: a run killed with SIGKILL after a checkpoint, then resumed,
gives the uninterrupted run's losses bitwise (CPU, fp32) and ends in the same state (model,
optimizer, RNG, data position; the LR is a function of the step), for 1 process, DP=2 with the distributed
optimizer (its sharded state is the hard case; plain DDP's optimizer is the one 1 process and
TP=2 use) and TP=2. The TP=2 checkpoint loads at TP=1 and at PP=2 with the same logits; a model
config that does not match a checkpoint is refused by file and key."""

import json
import time

import pytest
import torch
from cli_runner import REPO, Job, run_cli

from loongforge.core.checkpoint import Checkpoint, latest_checkpoint

pytestmark = pytest.mark.slow  # every test here runs lf-llm in fresh processes

STEPS, INTERVAL = 8, 2
COMMON = [
    f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
    "train.warmup_steps=1", "train.precision=fp32", f"checkpoint.interval={INTERVAL}", "checkpoint.keep_last=2",
    "log.interval=1", "log.progress=false", "log.tensorboard=false",
]
LAYOUTS = {
    "1proc": (1, []),
    "dp2-distopt": (2, ["train.use_distributed_optimizer=true"]),
    "tp2": (2, ["parallel.tp=2"]),
}


def args(run_dir, ckpt_dir, data_cache, extra) -> list[str]:
    return ["lf-llm", "train", *COMMON, f"log.run_dir={run_dir}", f"checkpoint.dir={ckpt_dir}",
            f"data.cache_dir={data_cache}", *extra]


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir, ckpt_dir, data_cache, extra, nproc):
    proc = run_cli(args(run_dir, ckpt_dir, data_cache, extra), nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return records(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, llm_data_cache):
    """``uninterrupted(layout)``: ``(checkpoint dir, metrics)`` of one uninterrupted run of that
    layout, made once per module and shared by every comparison against it."""
    runs = {}

    def get(name):
        if name not in runs:
            nproc, extra = LAYOUTS[name]
            run = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            recs = train(run, run / "checkpoints", llm_data_cache, extra, nproc)
            assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
            runs[name] = run / "checkpoints", recs
        return runs[name]

    return get


def kill_after_first_checkpoint(run_dir, ckpt_dir, data_cache, extra, nproc, timeout=300.0) -> int:
    """Start the run, SIGKILL its process group once a checkpoint has been committed; the step
    the checkpoint directory's ``latest`` names afterwards."""
    run_dir.mkdir()
    job = Job(args(run_dir, ckpt_dir, data_cache, extra), nproc=nproc, log_dir=run_dir)
    deadline = time.monotonic() + timeout
    while not (ckpt_dir / "latest").exists():
        if any(code is not None for code in job.poll()) or time.monotonic() > deadline:
            job.kill()
            logs = "\n".join((run_dir / f"rank{r}.log").read_text()[-3000:] for r in range(nproc))
            pytest.fail(f"the run ended or stalled before its first checkpoint:\n{logs}")
        time.sleep(0.01)
    codes = job.kill()
    assert all(code == -9 for code in codes), f"the run was not killed mid-way (exit codes {codes})"
    return Checkpoint(ckpt_dir).step


def assert_same_state(got_dir, want_dir):
    """Two checkpoints hold the same tensors bitwise and the same RNG and data position (the LR is a
    function of the step)."""
    got, want = Checkpoint(got_dir), Checkpoint(want_dir)
    assert got.step == want.step and got.manifest["consumed_samples"] == want.manifest["consumed_samples"]
    assert set(got.reader.keys()) == set(want.reader.keys())
    for key in want.reader.keys():
        assert torch.equal(got.tensor(key), want.tensor(key)), key
    for rank in range(want.manifest["world_size"]):
        a, b = got.objects(rank), want.objects(rank)
        assert a["step"] == b["step"] and a["data"] == b["data"]
        assert a["consumed_samples"] == b["consumed_samples"]
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
        assert a["rng"]["tracker"].keys() == b["rng"]["tracker"].keys()
        for name in b["rng"]["tracker"]:
            assert torch.equal(a["rng"]["tracker"][name], b["rng"]["tracker"][name]), name


# tp2 and 1proc under -m long (CI's time budget): tp2's checkpoint's TP shards are read back, exactly,
# by the reshard test below, and the kill-and-resume path of both is dp2-distopt's
# the default tier resumes one process (the reshard test below covers multi-process checkpoints); the
# distributed optimizer and TP=2 resumes under -m long (the default tier's time budget)
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.long) if name != "1proc" else name
                                    for name in LAYOUTS])
def test_kill_and_resume_is_exact(layout, uninterrupted, tmp_path, llm_data_cache):
    ref_ckpt, ref = uninterrupted(layout)
    nproc, extra = LAYOUTS[layout]
    ckpt = tmp_path / "checkpoints"
    resumed_from = kill_after_first_checkpoint(tmp_path / "killed", ckpt, llm_data_cache, extra, nproc)
    assert INTERVAL <= resumed_from < STEPS

    got = train(tmp_path / "resumed", ckpt, llm_data_cache, extra, nproc)
    assert [r["step"] for r in got] == list(range(resumed_from + 1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [r[key] for r in got] == [r[key] for r in ref[resumed_from:]], key
    assert latest_checkpoint(ckpt).name == latest_checkpoint(ref_ckpt).name
    assert_same_state(ckpt, ref_ckpt)


def test_model_config_mismatch_names_file_and_key(uninterrupted, tmp_path, llm_data_cache):
    ref_ckpt, _ = uninterrupted("1proc")
    step_dir = latest_checkpoint(ref_ckpt)
    proc = run_cli(args(tmp_path, tmp_path / "checkpoints", llm_data_cache,
                        ["model.ffn_hidden_size=256", f"checkpoint.load={step_dir}", "checkpoint.save=false"]))
    assert proc.returncode != 0
    assert str(step_dir / "manifest.json") in proc.stderr
    assert "model.ffn_hidden_size: checkpoint 128 vs config 256" in proc.stderr


def test_reshard_tp2_checkpoint_to_tp1_and_pp2(uninterrupted, tmp_path):
    """The TP=2 run's checkpoint gives the same logits loaded at TP=1 and at PP=2; what PP=2
    saves again is the TP=2 checkpoint's state bitwise and loads back at TP=2 exactly."""
    step_dir = latest_checkpoint(uninterrupted("tp2")[0])
    proc = run_cli([str(REPO / "tests" / "reshard_logits.py"), str(step_dir), str(tmp_path), *COMMON], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {name: torch.load(tmp_path / f"logits-{name}.pt") for name in ("tp2", "tp1", "pp2", "back", "tp1-init")}
    assert got["tp2"].shape == (2, 64, 4096)
    assert (got["tp1-init"] - got["tp1"]).abs().max() > 1e-2  # the comparisons below are of trained weights
    torch.testing.assert_close(got["tp1"], got["tp2"], rtol=0, atol=2e-6)
    torch.testing.assert_close(got["pp2"], got["tp2"], rtol=0, atol=2e-6)
    assert torch.equal(got["back"], got["tp2"])
    resaved, original = Checkpoint(tmp_path / "from-pp2"), Checkpoint(step_dir)
    for rank in range(2):  # loading in the saved layout restores each rank's random streams
        rng, saved = torch.load(tmp_path / f"rng-tp2-rank{rank}.pt"), original.objects(rank)["rng"]
        assert torch.equal(rng["torch"], saved["torch"])
        assert rng["tracker"].keys() == saved["tracker"].keys()
        assert all(torch.equal(rng["tracker"][k], saved["tracker"][k]) for k in saved["tracker"])
    assert resaved.manifest["layout"]["pp"] == 2 and original.manifest["layout"]["tp"] == 2
    assert set(resaved.reader.keys()) == set(original.reader.keys())
    for key in original.reader.keys():
        assert torch.equal(resaved.tensor(key), original.tensor(key)), key
