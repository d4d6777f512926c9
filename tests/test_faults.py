"""The fault suite: bad inputs and faults through the four ``lf-*`` CLIs.

Every case asserts the error contract (``loongforge.core.errors``): the exit code, one ``error:``
line on stderr naming the culprit (file, key or value), no traceback, and -- where a run had
something to lose -- that nothing was lost: the previous checkpoint loads and a resume continues.

Most cases run the CLI's ``main`` in this process (they fail before any training step); the
accelerator, hang and kill cases run real processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from cli_runner import BINDIR, Job, assert_one_error_line, cli_env, run_cli
from loongforge.core.checkpoint import Checkpoint
from loongforge.diffusion.cli import main as lf_diffusion
from loongforge.embodied.cli import main as lf_embodied
from loongforge.llm.cli import main as lf_llm
from loongforge.vlm.cli import main as lf_vlm

MAINS = {"lf-llm": lf_llm, "lf-vlm": lf_vlm, "lf-diffusion": lf_diffusion, "lf-embodied": lf_embodied}
CLIS = list(MAINS)
TINY = {"lf-llm": [], "lf-vlm": [], "lf-diffusion": ["data.synthetic_clips=8"], "lf-embodied": []}
CONVERT = {"lf-llm": "hf-to-lf", "lf-vlm": "hf-to-lf", "lf-diffusion": "lf-to-diffusers", "lf-embodied": "lerobot-to-lf"}


def run_inproc(capsys, cli: str, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = MAINS[cli](list(argv))
    return code, capsys.readouterr().err


# -- configuration: every mistake is one line naming the key, value or file, before any group --------
def _bad_yaml(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "bad.yaml"
    path.write_text("train:\n  steps: [1\n")
    return ["--config", str(path)], [str(path), "not valid YAML"]


CONFIG_CASES = {
    "unknown key": lambda tmp: (["train.stepz=3"], ["train.stepz"]),
    "bad value type": lambda tmp: (["train.steps=many"], ["train.steps", "many"]),
    "value out of range": lambda tmp: (["train.steps=0"], ["train.steps=0"]),
    "bad choice": lambda tmp: (["train.precision=fp64"], ["train.precision", "fp64"]),
    "malformed YAML file": _bad_yaml,
    "missing config file": lambda tmp: (["--config", str(tmp / "nope.yaml")], ["nope.yaml"]),
    "unknown config name": lambda tmp: (["--config", "no_such_config"], ["no_such_config"]),
    "not key=value": lambda tmp: (["stepz"], ["stepz"]),
    "layout larger than the world": lambda tmp: (["parallel.tp=3"], ["parallel.tp=3"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
@pytest.mark.parametrize("cli", CLIS)
def test_config_mistakes_are_one_line(cli, case, tmp_path, capsys):
    import torch.distributed as dist

    argv, names = CONFIG_CASES[case](tmp_path)
    code, err = run_inproc(capsys, cli, "train", *argv, f"log.run_dir={tmp_path / 'run'}")
    assert code == 2
    assert_one_error_line(err, *names)
    assert not dist.is_initialized()  # refused before any process group
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("cli", CLIS)
def test_debug_shows_the_traceback(cli, capsys):
    with pytest.raises(Exception, match="train.stepz"):
        MAINS[cli](["train", "--debug", "train.stepz=3"])


# -- accelerator: what a user sets in the environment -------------------------------------------
@pytest.mark.parametrize("value,names", [
    ("nonsense", ["LOONGFORGE_ACCELERATOR='nonsense'", "installed:"]),
    ("cuda", ["LOONGFORGE_ACCELERATOR='cuda'", "no device"]),
    ("xpu", ["LOONGFORGE_ACCELERATOR='xpu'", "torch_xmlir"]),
])
@pytest.mark.parametrize("cli", CLIS)
def test_accelerator_mistakes_are_one_line(cli, value, names, tmp_path, capsys, monkeypatch):
    if value == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.setenv("LOONGFORGE_ACCELERATOR", value)
    code, err = run_inproc(capsys, cli, "train", *TINY[cli], f"log.run_dir={tmp_path / 'run'}")
    assert code == 2
    assert_one_error_line(err, *names)


# -- data: the file (and line or sample) and what is wrong ---------------------------------------
def _vlm_jsonl(tmp: Path, second_line: str) -> Path:
    path = tmp / "vlm.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + second_line + "\n")
    return path


def _sft_jsonl(tmp: Path) -> Path:
    path = tmp / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    return path


def _truncated_shards(tmp: Path) -> tuple[list[str], list[str]]:
    """A preprocessed latent directory whose first shard lost its tail."""
    import shutil

    from loongforge.diffusion.data.shards import read_manifest
    from loongforge.diffusion.data.synthetic import builtin_dataset

    root = tmp / "latents"
    shutil.copytree(builtin_dataset(8, show_progress=False), root)  # a copy: the cached set stays whole
    shard = root / read_manifest(root)["shards"][0]["file"]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    return [f"data.root={root}"], [str(shard), "truncated", str(size), str(size - 100)]


def _not_a_lerobot_dataset(tmp: Path) -> tuple[list[str], list[str]]:
    (tmp / "ds" / "meta").mkdir(parents=True)
    return [f"data.root={tmp / 'ds'}"], ["data.root=", "meta/info.json"]


DATA_CASES = {
    ("lf-llm", "missing pre-training prefix"): lambda tmp: (
        [f"data.prefixes=[{tmp / 'corpus'}]"], [str(tmp / "corpus"), "not found"]),
    ("lf-llm", "SFT conversation without content"): lambda tmp: (
        ["--config", "sft_debug", f"sft.files=[{_sft_jsonl(tmp)}]"], [f"{tmp / 'chat.jsonl'}:2", "content"]),
    ("lf-llm", "missing SFT file"): lambda tmp: (
        ["--config", "sft_debug", f"sft.files=[{tmp / 'none.jsonl'}]"], [str(tmp / "none.jsonl")]),
    ("lf-vlm", "missing data file"): lambda tmp: ([f"data.path={tmp / 'none.jsonl'}"], ["data.path", "none.jsonl"]),
    ("lf-vlm", "invalid JSON line"): lambda tmp: (
        [f"data.path={_vlm_jsonl(tmp, '{not json')}"], [f"{tmp / 'vlm.jsonl'}:2", "not valid JSON"]),
    ("lf-vlm", "missing image"): lambda tmp: (
        [f"data.path={_vlm_jsonl(tmp, json.dumps({'image': 'gone.png', 'messages': [{'role': 'user', 'content': '<image>what?'}, {'role': 'assistant', 'content': 'a'}]}))}"],
        [f"{tmp / 'vlm.jsonl'}:2", "gone.png"]),
    ("lf-diffusion", "missing data root"): lambda tmp: ([f"data.root={tmp / 'latents'}"], [str(tmp / "latents"), "missing"]),
    ("lf-diffusion", "truncated latent shard"): _truncated_shards,
    ("lf-embodied", "data root is not a directory"): lambda tmp: ([f"data.root={tmp / 'none'}"], ["data.root=", "not a directory"]),
    ("lf-embodied", "not a LeRobot dataset"): _not_a_lerobot_dataset,
}


@pytest.mark.parametrize("cli,case", list(DATA_CASES))
def test_data_mistakes_name_the_file(cli, case, tmp_path, capsys):
    argv, names = DATA_CASES[(cli, case)](tmp_path)
    code, err = run_inproc(capsys, cli, "train", *TINY[cli], "train.steps=1", "log.progress=false",
                           f"log.run_dir={tmp_path / 'run'}", *argv)
    assert code == 2
    assert_one_error_line(err, *names)


# -- checkpoints and conversion --------------------------------------------------------------------
@pytest.mark.parametrize("cli", CLIS)
def test_missing_initial_checkpoint_is_named(cli, tmp_path, capsys):
    code, err = run_inproc(capsys, cli, "train", *TINY[cli], "train.steps=1", f"log.run_dir={tmp_path / 'run'}",
                           f"checkpoint.load={tmp_path / 'nowhere'}")
    assert code == 2
    assert_one_error_line(err, "nowhere")


@pytest.mark.parametrize("cli", CLIS)
def test_convert_of_a_missing_source_is_named(cli, tmp_path, capsys):
    code, err = run_inproc(capsys, cli, "convert", CONVERT[cli], str(tmp_path / "absent"), str(tmp_path / "out"))
    assert code == 2
    assert_one_error_line(err, "absent")
    assert not (tmp_path / "out").exists()


def _trained(cli: str, run: Path, *extra: str) -> None:
    assert MAINS[cli](["train", *TINY[cli], "train.steps=2", "train.global_batch_size=4", "log.progress=false",
                       f"log.run_dir={run}", *extra]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("cli", CLIS)
def test_a_corrupted_checkpoint_is_named_and_the_file_said(cli, tmp_path, capsys):
    run = tmp_path / "run"
    _trained(cli, run)
    latest = Checkpoint(run / "checkpoints").directory
    shard = sorted(latest.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit: the recorded hash no longer matches
    shard.write_bytes(bytes(data))
    code, err = run_inproc(capsys, cli, "train", *TINY[cli], "train.steps=3", "train.global_batch_size=4",
                           "log.progress=false", f"log.run_dir={run}")
    assert code == 2
    assert_one_error_line(err, shard.name)


@pytest.mark.slow
def test_resuming_with_another_model_names_the_key(tmp_path, capsys):
    run = tmp_path / "run"
    _trained("lf-llm", run)
    code, err = run_inproc(capsys, "lf-llm", "train", "train.steps=3", "train.global_batch_size=4",
                           "log.progress=false", f"log.run_dir={run}", "model.num_layers=3")
    assert code == 2
    assert_one_error_line(err, "num_layers", "manifest.json")


# -- non-finite values ---------------------------------------------------------------------------
@pytest.mark.slow
def test_skipping_non_finite_steps_keeps_the_run_going_and_every_checkpoint_finite(tmp_path, capsys):
    """``train.nonfinite_patience=0``: every non-finite step's update is skipped, the run ends
    normally, and the weights it saves are the last finite ones."""
    run = tmp_path / "run"
    code, _ = run_inproc(capsys, "lf-llm", "train", "train.steps=4", "train.global_batch_size=4", "train.lr=1e30",
                         "train.min_lr=0", "train.warmup_steps=0", "train.nonfinite_patience=0",
                         "checkpoint.interval=1", "log.progress=false", "log.interval=1", f"log.run_dir={run}")
    assert code == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert not math.isfinite(logged[-1]["loss"]) or not math.isfinite(logged[-1]["grad_norm"])
    ckpt = Checkpoint(run / "checkpoints")
    assert ckpt.step == 4
    for name, tensor in ckpt.tensors().items():
        assert torch.isfinite(tensor).all(), name


def test_patience_stops_after_that_many_bad_steps_in_a_row(tmp_path, capsys):
    run = tmp_path / "run"
    code, err = run_inproc(capsys, "lf-llm", "train", "train.steps=8", "train.global_batch_size=4", "train.lr=1e30",
                           "train.min_lr=0", "train.warmup_steps=0", "train.nonfinite_patience=3",
                           "checkpoint.save=false", "log.progress=false", "log.interval=1", f"log.run_dir={run}")
    assert code == 1
    line = assert_one_error_line(err, "not finite", "3 steps in a row", "train.nonfinite_patience")
    bad_step = int(line.split()[2].rstrip(":"))
    skipped = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]))]
    assert [r["step"] for r in skipped] == [bad_step - 2, bad_step - 1, bad_step]


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    """The save itself refuses non-finite weights (whatever made them), so ``keep_last`` never
    prunes the last finite checkpoint."""
    from loongforge.core.training.errors import NonFiniteError
    from loongforge.core.training.run import run_training
    from loongforge.embodied.cli import make_task
    from loongforge.embodied.config import load_train_config

    cfg = load_train_config(None, ["train.steps=1", "train.global_batch_size=4", "log.progress=false",
                                   f"log.run_dir={tmp_path / 'run'}", "checkpoint.keep_last=1"])
    done = run_training(cfg, make_task(cfg), "test")
    first = done.last_checkpoint
    assert first is not None

    def poison(trainer):
        with torch.no_grad():
            next(trainer.engine.model.parameters()).fill_(float("inf"))
        trainer.save()

    with pytest.raises(NonFiniteError, match="the weights are not finite; its checkpoint was not saved"):
        run_training(cfg, make_task(cfg), "test", after=poison)
    ckpt = Checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt.directory == first and all(torch.isfinite(t).all() for t in ckpt.tensors().values())


# -- disk full -------------------------------------------------------------------------------------
def _mount_tmpfs(mount: Path, size_bytes: int) -> None:
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")


@pytest.mark.slow
def test_disk_full_during_a_save_keeps_the_last_checkpoint(tmp_path, capsys):
    """Checkpoints go to a tmpfs with room for one and a half: the second save runs out of space;
    the run stops with one line, the first checkpoint stays ``latest`` and reads back whole, and the
    failed save's files are removed."""
    common = ["train", "train.global_batch_size=4", "log.progress=false", f"log.run_dir={tmp_path / 'run'}"]
    assert lf_llm([*common, "train.steps=1", f"checkpoint.dir={tmp_path / 'probe'}"]) == 0
    size = sum(f.stat().st_size for f in (tmp_path / "probe").rglob("*") if f.is_file())
    mount = tmp_path / "tmpfs"
    _mount_tmpfs(mount, size * 3 // 2)
    try:
        ckpt_dir = mount / "ckpt"
        code, err = run_inproc(capsys, "lf-llm", *common, "train.steps=4", "checkpoint.interval=1", "checkpoint.keep_last=1",
                               "checkpoint.resume=false", f"checkpoint.dir={ckpt_dir}")
        assert code == 2
        line = assert_one_error_line(err, "disk full", str(ckpt_dir), "is intact")
        kept = Checkpoint(ckpt_dir)
        assert kept.step == 1 and "checkpoint of step 2 not saved" in line
        assert not list(ckpt_dir.glob(".tmp-*"))  # the failed save's files are gone
        assert kept.tensors()  # the kept checkpoint reads back (hash-checked)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# -- hangs: nothing waits forever --------------------------------------------------------------------
@pytest.mark.slow
def test_a_stale_extension_lock_does_not_block_training(tmp_path):
    """A run killed while torch built a C++ extension leaves its lock behind; no training run
    compiles one, so the lock cannot block a later run."""
    ext = tmp_path / "torch_extensions"
    for name in ("share_storage_ext", "py312_cpu/share_storage_ext"):
        (ext / name).mkdir(parents=True)
        (ext / name / "lock").write_text("")
    proc = subprocess.run([str(BINDIR / "lf-llm"), "train", "train.steps=2", "log.progress=false",
                           f"log.run_dir={tmp_path / 'run'}"],
                          env=cli_env({"TORCH_EXTENSIONS_DIR": str(ext)}), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_rank_that_never_comes_times_out_with_a_message(tmp_path):
    """Rank 1 of a 2-process job never starts: rank 0's rendezvous gives up after parallel.timeout_s."""
    job = Job(["lf-llm", "train", "train.steps=2", "parallel.timeout_s=5", f"log.run_dir={tmp_path / 'run'}"],
              nproc=2, log_dir=tmp_path)
    job.procs[1].kill()
    start = time.monotonic()
    code = job.procs[0].wait(timeout=180)
    job.kill()
    out = (tmp_path / "rank0.log").read_text()
    assert code == 1 and time.monotonic() - start < 170
    assert_one_error_line(out, "communication with the other ranks failed", "parallel.timeout_s")


@pytest.mark.slow
def test_a_killed_rank_stops_the_other_with_a_message(tmp_path):
    job = Job(["lf-llm", "train", "train.steps=400", "parallel.timeout_s=20", "log.progress=false",
               f"log.run_dir={tmp_path / 'run'}"], nproc=2, log_dir=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and job.procs[0].poll() is None, (tmp_path / "rank0.log").read_text()
        time.sleep(0.2)
    os.kill(job.procs[1].pid, signal.SIGKILL)
    code = job.procs[0].wait(timeout=120)
    job.kill()
    out = (tmp_path / "rank0.log").read_text()
    assert code == 1
    assert_one_error_line(out, "communication with the other ranks failed")


@pytest.mark.slow
def test_an_error_on_every_rank_is_reported_once(tmp_path):
    """Under torchrun, a mistake every rank makes is one ``error:`` line (rank 0's), not one per
    rank, and no rank prints a traceback (torchrun's own failure report follows it)."""
    proc = run_cli(["lf-llm", "train", f"data.prefixes=[{tmp_path / 'corpus'}]", f"log.run_dir={tmp_path / 'run'}"],
                   nproc=2, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and str(tmp_path / "corpus") in lines[0] and "[rank" not in lines[0], out
    assert "[rank0]:" not in out and "[rank1]:" not in out, out


# -- kill -9 during saves: the last committed checkpoint always loads and resumes exactly -----------
def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_kill_during_saves_loses_nothing(tmp_path):
    """SIGKILL at several moments of a run that saves every step (so most kills land inside a
    save): the checkpoint ``latest`` names always loads, and resuming from it continues the
    uninterrupted run's losses bitwise."""
    common = ["train", "train.steps=6", "train.global_batch_size=4", "checkpoint.interval=1", "log.progress=false",
              "log.interval=1"]
    ref = tmp_path / "ref"
    assert subprocess.run([str(BINDIR / "lf-llm"), *common, f"log.run_dir={ref}"], env=cli_env(),
                          capture_output=True, timeout=300).returncode == 0
    expected = _losses(ref)
    for i, delay in enumerate((0.05, 0.3, 0.7)):
        run = tmp_path / f"killed{i}"
        job = Job(["lf-llm", *common, f"log.run_dir={run}"], log_dir=tmp_path)
        latest = run / "checkpoints" / "latest"
        deadline = time.monotonic() + 180
        while not latest.is_file():  # the first save has committed: the rest of the run is at risk
            assert time.monotonic() < deadline and job.procs[0].poll() is None
            time.sleep(0.01)
        time.sleep(delay)
        job.kill()
        step = Checkpoint(run / "checkpoints").step
        proc = subprocess.run([str(BINDIR / "lf-llm"), *common, f"log.run_dir={run}"], env=cli_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        resumed = {s: loss for s, loss in _losses(run).items() if s > step}
        assert resumed == {s: expected[s] for s in range(step + 1, 7)}, (delay, step)
