"""Preemption and resume as cluster users need them (``loongforge.core.training.preemption``,
``loongforge.core.training.resume_settings``), through the four ``lf-*`` CLIs.

- SIGTERM during training: the step under way finishes, every rank saves a checkpoint of it, one
  line names it, exit 75 (requeue); the same command then continues the uninterrupted run's losses
  bitwise. Ctrl-C: one line, a checkpoint, exit 130, no traceback. A second signal stops at once.
- The ``--nproc-per-node`` launcher forwards the signal to its workers and says so in one line.
- A resume with a new LR applies it from the resumed step (the logged LR changes; the first
  resumed step's loss is the checkpoint's weights', so the uninterrupted run's bitwise); settings
  the data position depends on are refused by name.

The signal cases send a real signal to this process from inside a step (``Trainer.train_step``
wrapped), so it arrives at a known step; the multi-process ones run real jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from cli_runner import BINDIR, Job, assert_one_error_line, cli_env
from loongforge.core.checkpoint import Checkpoint
from loongforge.core.checkpoint.storage import write_latest
from loongforge.core.launch import launch_local
from loongforge.core.training.loop import Trainer
from loongforge.core.training.preemption import INTERRUPT_EXIT_CODE, REQUEUE_EXIT_CODE
from loongforge.diffusion.cli import main as lf_diffusion
from loongforge.embodied.cli import main as lf_embodied
from loongforge.llm.cli import main as lf_llm
from loongforge.vlm.cli import main as lf_vlm

TESTS = Path(__file__).resolve().parent
MAINS = {"lf-llm": lf_llm, "lf-vlm": lf_vlm, "lf-diffusion": lf_diffusion, "lf-embodied": lf_embodied}
CLIS = list(MAINS)
TINY = {"lf-llm": [], "lf-vlm": [], "lf-diffusion": ["data.synthetic_clips=8"], "lf-embodied": []}
COMMON = ["train.global_batch_size=4", "train.warmup_steps=1", "log.progress=false", "log.interval=1",
          "log.tensorboard=false"]


def train(capsys, cli: str, run: Path, *extra: str) -> tuple[int, str, str]:
    """``cli train`` in this process; ``(exit code, stdout, stderr)``."""
    capsys.readouterr()
    code = MAINS[cli](["train", *TINY[cli], *COMMON, f"log.run_dir={run}", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def records(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def signal_after_step(monkeypatch, signum: int, step: int) -> None:
    """This process gets ``signum`` while step ``step`` finishes (its handler runs before the next
    step boundary)."""
    original = Trainer.train_step

    def train_step(self, batch):
        result = original(self, batch)
        if result.step == step:
            os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(Trainer, "train_step", train_step)


def assert_same_checkpoint(got: Path, want: Path) -> None:
    a, b = Checkpoint(got), Checkpoint(want)
    assert a.step == b.step and set(a.reader.keys()) == set(b.reader.keys())
    for key in b.reader.keys():
        assert torch.equal(a.tensor(key), b.tensor(key)), key


# -- SIGTERM and Ctrl-C in the loop -----------------------------------------------------------------
@pytest.mark.parametrize("cli", ["lf-llm", "lf-diffusion"])  # one per engine: megatron-core, PyTorch-native
def test_sigterm_saves_the_step_reached_and_the_resume_is_bitwise(cli, tmp_path, capsys, monkeypatch):
    steps = ["train.steps=4", "checkpoint.interval=0"]  # no checkpoint but the last: the stop's is its own
    code, _, err = train(capsys, cli, tmp_path / "straight", *steps)
    assert code == 0, err
    want = records(tmp_path / "straight")

    run = tmp_path / "stopped"
    handler = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:
        signal_after_step(patch, signal.SIGTERM, 2)
        code, out, err = train(capsys, cli, run, *steps)
    assert code == REQUEUE_EXIT_CODE, err
    assert "Traceback" not in err
    line = [line for line in out.splitlines() if "stopped by" in line]
    assert len(line) == 1, out
    assert (f"stopped by SIGTERM at step 2: checkpoint {run / 'checkpoints' / 'step_00000002'} saved; "
            f"exit {REQUEUE_EXIT_CODE} (requeue") in line[0]
    assert Checkpoint(run / "checkpoints").step == 2 and sorted(records(run)) == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is handler  # the loop's handler is gone with it

    code, _, err = train(capsys, cli, run, *steps)  # the same command again
    assert code == 0, err
    got = records(run)
    assert sorted(got) == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [got[s][key] for s in got] == [want[s][key] for s in got], key
    assert_same_checkpoint(run / "checkpoints", tmp_path / "straight" / "checkpoints")


@pytest.mark.parametrize("cli", CLIS)
def test_ctrl_c_is_one_line_and_a_checkpoint(cli, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    signal_after_step(monkeypatch, signal.SIGINT, 1)
    code, out, err = train(capsys, cli, run, "train.steps=5")
    assert code == INTERRUPT_EXIT_CODE
    assert "Traceback" not in err + out and "KeyboardInterrupt" not in err + out
    lines = [line for line in (out + err).splitlines() if "Ctrl-C" in line]
    assert lines == [f"{cli}: stopped by Ctrl-C (SIGINT) at step 1: checkpoint "
                     f"{run / 'checkpoints' / 'step_00000001'} saved; the same command resumes it"]
    assert Checkpoint(run / "checkpoints").step == 1
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_stop_with_no_step_since_the_last_checkpoint_saves_nothing_new(tmp_path, capsys, monkeypatch):
    """A stop right after a cadence save keeps that checkpoint and writes no other."""
    run = tmp_path / "run"
    signal_after_step(monkeypatch, signal.SIGUSR1, 2)
    code, out, _ = train(capsys, "lf-llm", run, "train.steps=5", "checkpoint.interval=2")
    assert code == REQUEUE_EXIT_CODE
    assert (f"stopped by SIGUSR1 at step 2: no step since the last checkpoint (step 2, "
            f"{run / 'checkpoints' / 'step_00000002'})") in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000002"]


def test_ctrl_c_before_training_is_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the model is being built (Python's own handler: KeyboardInterrupt): one line,
    exit 130, the run directory given back."""
    import loongforge.core.training.loop as loop

    build = loop.make_engine

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return build(*args, **kwargs)

    monkeypatch.setattr(loop, "make_engine", interrupted)
    code, out, err = train(capsys, "lf-llm", tmp_path / "run", "train.steps=2")
    assert code == INTERRUPT_EXIT_CODE
    assert "Traceback" not in err and err.strip().splitlines() == ["lf-llm: interrupted (Ctrl-C)"]
    assert not (tmp_path / "run" / "run.lock").exists()


SECOND_SIGNAL = """
import os, signal, sys, time
from loongforge.core.training.preemption import StopSignals
with StopSignals() as signals:
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same request again (a launcher's forwarded copy)
    time.sleep(0.2)
    print("one request:", signals.received, flush=True)
    time.sleep(float(sys.argv[1]))
    os.kill(os.getpid(), signal.SIGTERM)  # a second request
    time.sleep(5)
print("still running", flush=True)
"""


def test_a_second_signal_stops_at_once():
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL, "2.2"], capture_output=True, text=True, timeout=60,
                          env=cli_env())
    assert proc.returncode == -signal.SIGTERM
    assert proc.stdout == f"one request: {int(signal.SIGTERM)}\n"
    assert proc.stderr == "SIGTERM again: stopping at once, without a checkpoint\n"


# -- the launcher and several ranks ----------------------------------------------------------------
def test_the_launcher_forwards_a_stop_signal_and_says_so(tmp_path, monkeypatch):
    """SIGTERM to ``launch_local``: forwarded to both workers (``stop_probe``), which stop as the
    loop does (exit 75); one line from the launcher, no traceback."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    lines: list[str] = []
    handler = signal.getsignal(signal.SIGTERM)

    def preempt():
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=preempt)
    sender.start()
    code = launch_local("stop_probe", [str(tmp_path)], 2, report=lines.append, prog="lf-test")
    sender.join()
    assert code == REQUEUE_EXIT_CODE
    assert lines == ["lf-test: SIGTERM: forwarded to the 2 workers; they stopped together after a step (the line "
                     f"above names the checkpoint); exit {REQUEUE_EXIT_CODE} (requeue)"]
    assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-0", "stopped-1"]
    assert signal.getsignal(signal.SIGTERM) is handler


def test_ranks_agree_on_a_signal_only_one_of_them_got(tmp_path):
    """SIGTERM to rank 1 of two (``agree_probe``): both stop after the same step, on SIGTERM."""
    job = Job(["python", str(TESTS / "agree_probe.py"), str(tmp_path)], nproc=2, log_dir=tmp_path)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready-*"))) < 2:
        assert time.monotonic() < deadline and job.poll() == [None, None], (tmp_path / "rank0.log").read_text()
        time.sleep(0.02)
    time.sleep(0.3)
    os.kill(job.procs[1].pid, signal.SIGTERM)
    assert job.wait(timeout=60) == [0, 0], (tmp_path / "rank1.log").read_text()
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["step"] == ranks[1]["step"] > 0
    assert [r["signal"] for r in ranks] == [signal.SIGTERM] * 2
    assert [r["received"] for r in ranks] == [0, signal.SIGTERM]


@pytest.mark.long  # two lf-llm processes, ~50 s; test_ranks_agree_on_a_signal_only_one_of_them_got is its quick sibling
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 only: both ranks agree at the next step boundary, save that step together
    and exit 75; rank 0 names the checkpoint."""
    run = tmp_path / "run"
    job = Job(["lf-llm", "train", "train.steps=400", *COMMON, "parallel.timeout_s=60", f"log.run_dir={run}"],
              nproc=2, log_dir=tmp_path)
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and job.poll() == [None, None], (tmp_path / "rank0.log").read_text()
        time.sleep(0.05)
    os.kill(job.procs[1].pid, signal.SIGTERM)
    codes = job.wait(timeout=240)
    assert codes == [REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE], (tmp_path / "rank0.log").read_text()
    step = Checkpoint(run / "checkpoints").step
    assert step == max(records(run))
    log = (tmp_path / "rank0.log").read_text()
    assert f"stopped by SIGTERM at step {step}: checkpoint {run / 'checkpoints' / f'step_{step:08d}'} saved" in log
    assert "Traceback" not in log + (tmp_path / "rank1.log").read_text()


@pytest.mark.long
def test_sigterm_to_the_launcher_checkpoints_and_the_resume_is_bitwise(tmp_path):
    """``lf-llm train --nproc-per-node 2`` gets SIGTERM mid-run: the workers save the step reached,
    the launcher says so in one line and exits 75, no worker is left; the same command continues
    the uninterrupted run's losses bitwise."""
    command = [str(BINDIR / "lf-llm"), "train", "--nproc-per-node", "2", "train.steps=40", *COMMON]
    straight = subprocess.run([*command, f"log.run_dir={tmp_path / 'straight'}"], env=cli_env(), capture_output=True,
                              text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run = tmp_path / "run"
    launcher = subprocess.Popen([*command, f"log.run_dir={run}"], env=cli_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == REQUEUE_EXIT_CODE, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err
    assert sum("forwarded to the 2 workers" in line for line in err.splitlines()) == 1
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if f"log.run_dir={run}" in (p.info["cmdline"] or [])]
    step = Checkpoint(run / "checkpoints").step
    assert 2 <= step < 40 and step == max(records(run))
    again = subprocess.run([*command, f"log.run_dir={run}"], env=cli_env(), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    want, got = records(tmp_path / "straight"), records(run)
    assert sorted(got) == list(range(1, 41))
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in got]
    assert_same_checkpoint(run / "checkpoints", tmp_path / "straight" / "checkpoints")


# -- resume with new settings ------------------------------------------------------------------------
def _back_to_step(run: Path, step: int) -> None:
    """The run directory as if the run had stopped at ``step`` (a checkpoint there, ``latest`` naming it)."""
    root = run / "checkpoints"
    write_latest(root, f"step_{step:08d}")
    for later in root.glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)


NEW_LR = {"lf-llm": [], "lf-vlm": [], "lf-diffusion": [], "lf-embodied": [],
          "lf-llm distributed optimizer": ["train.use_distributed_optimizer=true"]}


@pytest.mark.parametrize("case", list(NEW_LR))
def test_a_resume_with_a_new_lr_applies_it_from_the_resumed_step(case, tmp_path, capsys):
    cli = case.split()[0]
    run = tmp_path / "run"
    first = ["train.steps=3", "checkpoint.interval=2", "checkpoint.keep_last=0", "train.lr=0.003", "train.min_lr_ratio=0.1",
             *NEW_LR[case]]
    code, _, err = train(capsys, cli, run, *first)
    assert code == 0, err
    before = records(run)
    _back_to_step(run, 2)

    code, out, err = train(capsys, cli, run, *first, "train.lr=0.002", "train.steps=4", "train.clip_grad=0.5")
    assert code == 0, err
    assert ("resumed at step 2 with train.lr 0.003 -> 0.002, train.steps 3 -> 4, train.clip_grad 1.0 -> 0.5; they "
            "apply from step 3 on") in out
    after = records(run)
    assert sorted(after) == [1, 2, 3, 4]
    assert after[3]["loss"] == before[3]["loss"]  # the checkpoint's weights: the step before any new update
    assert after[3]["lr"] != before[3]["lr"]
    from loongforge.core.training.schedule import lr_at
    from loongforge.core.training.schema import TrainConfig

    new = TrainConfig(steps=4, lr=0.002, min_lr_ratio=0.1, warmup_steps=1)
    assert [after[s]["lr"] for s in (3, 4)] == pytest.approx([lr_at(2, new), lr_at(3, new)], rel=1e-12)
    resumes = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert resumes[-1]["step"] == 2 and resumes[-1]["changed"]["train.lr"] == {"from": 0.003, "to": 0.002}
    assert Checkpoint(run / "checkpoints").manifest["config"]["train"]["lr"] == 0.002


def test_a_resume_may_not_change_what_the_data_position_depends_on(tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = train(capsys, "lf-llm", run, "train.steps=1")
    assert code == 0, err
    config = (run / "config.yaml").read_text()
    code, _, err = train(capsys, "lf-llm", run, "train.steps=2", "train.global_batch_size=8")
    assert code == 2
    assert_one_error_line(err, f"cannot resume from {run / 'checkpoints' / 'step_00000001'}",
                          "train.global_batch_size=8 (the checkpoint's run has 4)")
    assert (run / "config.yaml").read_text() == config
