"""The fault suite: bad inputs and faults through the four ``lf-*`` CLIs.

Every case asserts the error contract (``loongforge.core.errors``): the exit code, one ``error:``
line on stderr naming the culprit (file, key or value), no traceback, and -- where a run had
something to lose -- that nothing was lost: the previous checkpoint loads and a resume continues.

Most cases run the CLI's ``main`` in this process (they fail before any training step, or train a
few steps of a tiny model); the accelerator, hang and kill cases, the holder of a run directory and
the launcher case run real processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_runner import BINDIR, Job, assert_one_error_line, cli_env, run_cli
from loongforge.core.checkpoint import Checkpoint, save_checkpoint
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
    "overwrite while resuming": lambda tmp: (["checkpoint.overwrite=true"], ["checkpoint.overwrite=true",
                                                                           "checkpoint.resume=false"]),
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


# a group each CLI swaps with group=option, and a near miss of one of its options
GROUPS = {"lf-llm": ("model", "qwen3_debg", "qwen3_debug"), "lf-vlm": ("foundation", "qwen3_debg", "qwen3_debug"),
          "lf-diffusion": ("model", "nope", None), "lf-embodied": ("model", "pi05_bse", "pi05_base")}
DEFAULT_CONFIGS = {"lf-llm": "train_debug", "lf-vlm": "vlm_debug", "lf-diffusion": "tiny", "lf-embodied": "train"}


@pytest.mark.parametrize("cli", CLIS)
def test_a_first_hours_mistakes_are_one_line_that_says_what_was_meant(cli, tmp_path, capsys):
    """A misspelt key, group option or config name is one line with the nearest match (no internal
    class name, no file path); a YAML file given where an override goes points at ``--config``."""
    run = f"log.run_dir={tmp_path / 'run'}"
    code, err = run_inproc(capsys, cli, "train", "train.stpes=3", run)
    assert code == 2
    line = assert_one_error_line(err, "unknown key 'train.stpes' (did you mean 'train.steps'?)")
    assert "Config" not in line and "/" not in line
    group, option, meant = GROUPS[cli]
    code, err = run_inproc(capsys, cli, "train", f"{group}={option}", run)
    assert code == 2
    line = assert_one_error_line(err, f"{group}={option}", "choices:", *([f"did you mean {meant!r}"] if meant else []))
    assert "search path" not in err
    name = DEFAULT_CONFIGS[cli]
    code, err = run_inproc(capsys, cli, "train", "--config", name[:-1], run)
    assert code == 2
    assert_one_error_line(err, f"no config named {name[:-1]!r} (did you mean {name!r}?)")
    code, err = run_inproc(capsys, cli, "train", "my.yaml", run)
    assert code == 2
    assert_one_error_line(err, "'my.yaml'", "did you mean --config my.yaml?")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["log.run_dir", "checkpoint.dir"])
@pytest.mark.parametrize("cli", CLIS)
def test_a_directory_key_naming_a_file_is_one_line(cli, key, tmp_path, capsys):
    """``log.run_dir`` or ``checkpoint.dir`` at a file, or under one: one line naming the key and
    the file, before the task is built or any process group made; the file is left alone."""
    import torch.distributed as dist

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    for value, names in ((a_file, [f"{key}={a_file} is a file"]), (a_file / "sub", [f"{key}={a_file / 'sub'}",
                                                                                      f"lies under {a_file}"])):
        where = [f"log.run_dir={value}"] if key == "log.run_dir" else [f"log.run_dir={tmp_path / 'run'}",
                                                                        f"checkpoint.dir={value}"]
        code, err = run_inproc(capsys, cli, "train", *TINY[cli], *where)
        assert code == 2
        assert_one_error_line(err, *names, "not a directory")
        assert not dist.is_initialized()
    assert a_file.read_text() == "not a directory\n"
    assert not (tmp_path / "run").exists()


def test_an_unknown_key_with_a_model_group_names_the_key(capsys):
    """``--model smolvla`` swaps the model (policy) group; a misspelt key elsewhere is named (and the
    smolvla keys are not reported against the default policy's config)."""
    code, err = run_inproc(capsys, "lf-embodied", "train", "--model", "smolvla", "foo.bar=1")
    assert code == 2
    line = assert_one_error_line(err, "foo.bar")
    assert "model." not in line


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
    return [f"data.path={root}"], [str(shard), "truncated", str(size), str(size - 100)]


def _not_a_lerobot_dataset(tmp: Path) -> tuple[list[str], list[str]]:
    (tmp / "ds" / "meta").mkdir(parents=True)
    return [f"data.path={tmp / 'ds'}"], ["data.path=", "meta/info.json"]


def _truncated_lerobot_file(rel: str):
    """A copy of the synthetic LeRobot dataset whose ``rel`` lost its second half."""
    def case(tmp: Path) -> tuple[list[str], list[str]]:
        import shutil

        from loongforge.embodied.data.synthetic import ensure_synthetic_dataset

        root = tmp / "ds"
        shutil.copytree(ensure_synthetic_dataset(), root)  # a copy: the cached set stays whole
        data = (root / rel).read_bytes()
        (root / rel).write_bytes(data[: len(data) // 2])
        return [f"data.path={root}"], [str(root / rel), "truncated"]

    return case


def _empty_sft_file(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "empty.jsonl"
    path.write_text("")
    return ["--config", "sft_debug", f"sft.files=[{path}]"], ["sft.files", str(path), "no conversations"]


def _ids_past_the_vocabulary(tmp: Path) -> tuple[list[str], list[str]]:
    """An indexed dataset written with ids up to 5999 (another tokenizer's), for a model of 4096."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp / "other_tokenizer"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in range(20):
        ids = np.arange(doc * 300, doc * 300 + 300) % 6000
        builder.add_document(ids.astype(np.uint16), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return [f"data.prefixes=[{prefix}]", "model.vocab_size=4096"], [str(prefix), "token id", "model.vocab_size=4096"]


def _truncated_image(tmp: Path) -> tuple[list[str], list[str]]:
    """A PNG whose header reads but whose pixels were cut off half-way."""
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp / "whole.png")
    data = (tmp / "whole.png").read_bytes()
    (tmp / "cut.png").write_bytes(data[: len(data) // 2])
    record = {"image": "cut.png", "messages": [{"role": "user", "content": "<image>what?"},
                                               {"role": "assistant", "content": "a"}]}
    return ([f"data.path={_vlm_jsonl(tmp, json.dumps(record))}", "train.global_batch_size=2"],
            [f"{tmp / 'vlm.jsonl'}:2", str(tmp / "cut.png"), "truncated"])


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
    ("lf-diffusion", "missing data root"): lambda tmp: ([f"data.path={tmp / 'latents'}"], [str(tmp / "latents"), "missing"]),
    ("lf-diffusion", "truncated latent shard"): _truncated_shards,
    ("lf-embodied", "data root is not a directory"): lambda tmp: ([f"data.path={tmp / 'none'}"], ["data.path=", "not a directory"]),
    ("lf-embodied", "not a LeRobot dataset"): _not_a_lerobot_dataset,
    ("lf-embodied", "truncated meta/info.json"): _truncated_lerobot_file("meta/info.json"),
    ("lf-embodied", "truncated meta/tasks.parquet"): _truncated_lerobot_file("meta/tasks.parquet"),
    ("lf-llm", "empty SFT file"): _empty_sft_file,
    ("lf-llm", "tokenizer larger than the model's vocabulary"): lambda tmp: (
        ["model.vocab_size=64"], ["tokenizer", "model.vocab_size=64"]),
    ("lf-llm", "token ids past the model's vocabulary"): _ids_past_the_vocabulary,
    ("lf-vlm", "truncated image"): _truncated_image,
    ("lf-vlm", "fewer samples than one step takes"): lambda tmp: (  # two records, four a step
        [f"data.path={_vlm_jsonl(tmp, json.dumps({'messages': [{'role': 'user', 'content': 'a'},
                                                              {'role': 'assistant', 'content': 'b'}]}))}",
         "train.global_batch_size=4"], ["2 samples", "train.global_batch_size"]),
    ("lf-embodied", "camera not in the dataset"): lambda tmp: (["data.image_keys=[nope]"], ["data.image_keys", "'nope'"]),
    ("lf-llm", "LoRA targets that match no layer"): lambda tmp: (
        ["lora.rank=4", "lora.target_modules=[nope_proj]"], ["lora.target_modules=['nope_proj']", "match no linear layer"]),
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
    assert "num_layers: 2" in (run / "config.yaml").read_text()  # the refused config is not recorded


# -- a run directory has one owner, is never rewound, and its record survives ---------------------
HOLD = """
import os, signal, sys
from loongforge.core.training.run_dir import RunDirLock
RunDirLock(sys.argv[1]).acquire()
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)  # gone without releasing: the lock file stays
print("held", flush=True)
sys.stdin.read()  # until the test closes stdin
"""


def _hold(run: Path, then: str = "wait") -> subprocess.Popen:
    """Another process that takes ``run`` as a training run would (``then="die"``: and is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run), then], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=cli_env())
    if then == "wait":
        assert proc.stdout.readline() == "held\n"
    else:
        assert proc.wait(timeout=60) == -signal.SIGKILL
    return proc


@pytest.mark.parametrize("cli", CLIS)
def test_a_second_run_in_a_held_run_dir_is_refused_naming_the_holder(cli, tmp_path, capsys):
    run = tmp_path / "run"
    holder = _hold(run)
    try:
        code, err = run_inproc(capsys, cli, "train", *TINY[cli], "train.steps=1", "log.progress=false",
                               f"log.run_dir={run}")
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert code == 2
    assert_one_error_line(err, f"log.run_dir={run} is in use by pid {holder.pid}", "one run at a time")
    assert sorted(p.name for p in run.iterdir()) == ["run.lock"]  # nothing of the refused run: no record, no checkpoint


def test_a_run_dir_whose_holder_is_gone_is_taken_over_and_released_at_the_end(tmp_path, capsys):
    run = tmp_path / "run"
    gone = _hold(run, then="die")
    assert json.loads((run / "run.lock").read_text())["pid"] == gone.pid  # left behind by the killed process
    capsys.readouterr()
    assert lf_llm(["train", "train.steps=1", "train.global_batch_size=4", "log.progress=false", f"log.run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert f"was held by pid {gone.pid}" in out and "no longer running; this run takes it over" in out
    assert not (run / "run.lock").exists()  # released when the run ended
    assert Checkpoint(run / "checkpoints").step == 1


def test_a_fresh_run_beside_an_earlier_runs_checkpoints_is_refused_unless_it_overwrites(tmp_path, capsys):
    """``checkpoint.resume=false`` into a run directory with checkpoints: refused with nothing
    changed; with ``checkpoint.overwrite=true`` the earlier checkpoints are removed first, so
    ``latest`` names the new run's step (never the old run's later one) and every step of
    ``metrics.jsonl`` is the new run's (the old record kept beside it)."""
    run = tmp_path / "run"
    common = ["train", "train.global_batch_size=4", "checkpoint.interval=1", "log.progress=false", "log.interval=1",
              f"log.run_dir={run}"]
    assert lf_llm([*common, "train.steps=3"]) == 0
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "checkpoints/latest")}
    code, err = run_inproc(capsys, "lf-llm", *common, "train.steps=2", "checkpoint.resume=false", "train.lr=5e-4")
    assert code == 2
    assert_one_error_line(err, str(run / "checkpoints"), "latest is step_00000003", "checkpoint.resume=false",
                          "checkpoint.overwrite=true")
    assert {name: (run / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert not (run / "run.lock").exists()  # released on the way out of a refused run too

    capsys.readouterr()
    assert lf_llm([*common, "train.steps=2", "checkpoint.resume=false", "checkpoint.overwrite=true",
                   "checkpoint.keep_last=0"]) == 0
    out = capsys.readouterr().out
    assert "removed the earlier run's checkpoints" in out and "metrics.jsonl.bak-1" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert Checkpoint(run / "checkpoints").step == 2
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert (run / "metrics.jsonl.bak-1").read_bytes() == before["metrics.jsonl"]


def test_a_resume_after_a_crash_mid_record_logs_every_step_once(tmp_path, capsys):
    """A run killed after logging steps past its last checkpoint, half-way through a line: the
    resume cuts ``metrics.jsonl`` back to the checkpoint's step (the file as it was kept beside
    it), so every step appears once, with the resumed run's values."""
    run = tmp_path / "run"
    common = ["train", "train.steps=4", "train.global_batch_size=4", "checkpoint.interval=2", "log.progress=false",
              "log.interval=1", f"log.run_dir={run}"]
    assert lf_llm(common) == 0
    first = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    # the state a crash during step 4 leaves: its checkpoint not written, its record cut off mid-line
    import shutil

    from loongforge.core.checkpoint.storage import write_latest

    write_latest(run / "checkpoints", "step_00000002")
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    crashed = "".join(lines[:3]) + lines[3][:25]
    (run / "metrics.jsonl").write_text(crashed)

    capsys.readouterr()
    assert lf_llm(common) == 0
    assert "cut back to its records up to step 2" in capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {r["step"]: r["loss"] for r in records} == first  # resumed exactly
    assert (run / "metrics.jsonl.bak-1").read_text() == crashed


def test_a_lora_runs_checkpoint_root_is_not_an_output_and_its_adapters_are_checked_on_resume(tmp_path, capsys):
    """``lf-llm lora merge`` into the run's own checkpoint root is refused before anything is
    written (``latest`` stays); resuming with ``lora.rank=0`` names the rank the run was trained
    with (the config record untouched); the run then resumes as it was."""
    run = tmp_path / "run"
    common = ["train", "train.global_batch_size=4", "lora.rank=4", "log.progress=false", f"log.run_dir={run}"]
    assert lf_llm([*common, "train.steps=2"]) == 0
    root = run / "checkpoints"
    latest, config = (root / "latest").read_text(), (run / "config.yaml").read_text()
    for out in (root, root / "merged"):
        code, err = run_inproc(capsys, "lf-llm", "lora", "merge", str(root), str(out))
        assert code == 2
        assert_one_error_line(err, f"lora merge OUT {out}", f"checkpoint root {root}")
    assert (root / "latest").read_text() == latest and not (root / "merged").exists()
    assert not (root / "step_00000000").exists()

    code, err = run_inproc(capsys, "lf-llm", *common[:-2], "lora.rank=0", "log.progress=false", f"log.run_dir={run}",
                           "train.steps=3")
    assert code == 2
    assert_one_error_line(err, "trained with LoRA rank 4", "lora.rank=0", str(root / "step_00000002"))
    assert (run / "config.yaml").read_text() == config  # written only once a config is accepted
    assert lf_llm([*common, "train.steps=3"]) == 0
    assert Checkpoint(root).step == 3


@pytest.mark.parametrize("cli", CLIS)
def test_outputs_inside_a_checkpoint_root_are_refused(cli, tmp_path, capsys):
    """``convert``'s OUT (and ``train --save-FORMAT OUT``) at or inside a checkpoint root: refused
    before the source is read; the root keeps its ``latest``."""
    root = tmp_path / "run" / "checkpoints"
    save_checkpoint(root, 3, {"w": torch.zeros(2)}, manifest={"family": "llama"})
    for out in (root, root / "step_00000003" / "export", root / "out"):
        code, err = run_inproc(capsys, cli, "convert", CONVERT[cli], str(tmp_path / "anything"), str(out))
        assert code == 2
        assert_one_error_line(err, f"OUT {out}", f"checkpoint root {root}", "latest step_00000003")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]
    save = {"lf-llm": "--save-hf", "lf-vlm": "--save-hf", "lf-diffusion": "--save-diffusers",
            "lf-embodied": "--save-lerobot"}[cli]
    code, err = run_inproc(capsys, cli, "train", save, str(root / "export"), f"log.run_dir={tmp_path / 'other'}")
    assert code == 2
    assert_one_error_line(err, f"{save} {root / 'export'}", f"checkpoint root {root}")


def _foreign_checkpoint(tmp: Path, family: str) -> Path:
    """A checkpoint root of model family ``family`` (its manifest is what a reader checks first)."""
    root = tmp / family / "checkpoints"
    save_checkpoint(root, 1, {"model.w": torch.zeros(2)}, manifest={"family": family, "config": {}})
    return root


FOREIGN = {  # (command, the family of a checkpoint it does not read, the command that does)
    "lf-diffusion convert lf-to-diffusers": ("llama", "lf-llm"),
    "lf-diffusion sample --checkpoint": ("llama", "lf-llm"),
    "lf-diffusion convert lora-to-peft": ("pi05", "lf-embodied"),
    "lf-embodied convert lf-to-lerobot": ("llama", "lf-llm"),
    "lf-embodied eval --checkpoint": ("wan", "lf-diffusion"),
    "lf-llm convert lf-to-hf": ("pi05", "lf-embodied"),
    "lf-vlm convert lf-to-hf": ("llama", "lf-llm"),
}


@pytest.mark.parametrize("command", list(FOREIGN))
def test_a_checkpoint_of_another_modality_is_named_as_such(command, tmp_path, capsys):
    family, owner = FOREIGN[command]
    root = _foreign_checkpoint(tmp_path, family)
    cli, *words = command.split()
    argv = [*words, str(root)] if words[-1].startswith("--") else [*words, str(root), str(tmp_path / "out")]
    code, err = run_inproc(capsys, cli, *argv)
    assert code == 2
    assert_one_error_line(err, str(root / "step_00000001"), f"an {owner} checkpoint (model family {family!r})",
                          f"not one of {cli}'s")
    assert not (tmp_path / "out").exists()


def test_lerobot_to_lf_of_a_file_that_is_not_safetensors_is_named(tmp_path, capsys):
    source = tmp_path / "model.safetensors"
    source.write_text("not safetensors\n")
    code, err = run_inproc(capsys, "lf-embodied", "convert", "lerobot-to-lf", str(source), str(tmp_path / "out.safetensors"))
    assert code == 2
    assert_one_error_line(err, str(source), "not a safetensors file")
    assert not (tmp_path / "out.safetensors").exists()


def test_sample_with_an_image_that_does_not_decode_is_named(tmp_path, capsys):
    """``lf-diffusion sample --image`` of a file that is no image, or a PNG cut off half-way: one
    line naming it, before any model is loaded (so the checkpoint needs only its manifest: the
    config of an image-to-video model)."""
    from loongforge.core.config import to_dict
    from loongforge.diffusion.cli import load_recipe

    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 1, {"model.w": torch.zeros(2)},
                    manifest={"family": "wan", "config": to_dict(load_recipe("tiny_ti2v", []))})
    not_image, cut = tmp_path / "notes.png", tmp_path / "cut.png"
    not_image.write_text("not an image\n")
    import numpy as np
    from PIL import Image

    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8) + 7).save(tmp_path / "whole.png")
    whole = (tmp_path / "whole.png").read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    for image in (not_image, cut):
        code, err = run_inproc(capsys, "lf-diffusion", "sample", "--run", str(run), "--image", str(image))
        assert code == 2
        assert_one_error_line(err, str(image), "cannot decode the image")
    assert not (run / "samples").exists()


@pytest.mark.slow
def test_lora_targets_that_match_nothing_are_one_line_from_the_launcher(tmp_path):
    """``lf-llm train --nproc-per-node 2``: the error every rank raises building its model is one
    line and exit 2, no rank's traceback."""
    proc = run_cli(["lf-llm", "train", "--nproc-per-node", "2", "lora.rank=4", "lora.target_modules=[nope_proj]",
                    "train.steps=1", "log.progress=false", f"log.run_dir={tmp_path / 'run'}"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_error_line(proc.stdout + proc.stderr, "lora.target_modules=['nope_proj']", "match no linear layer")
    assert "[rank0]:" not in proc.stderr and "[rank1]:" not in proc.stderr


# -- non-finite values ---------------------------------------------------------------------------
@pytest.mark.slow
def test_skipping_non_finite_steps_keeps_the_run_going_and_every_checkpoint_finite(tmp_path, capsys):
    """``train.nonfinite_patience=0``: every non-finite step's update is skipped, the run ends
    normally, and the weights it saves are the last finite ones."""
    run = tmp_path / "run"
    code, _ = run_inproc(capsys, "lf-llm", "train", "train.steps=4", "train.global_batch_size=4", "train.lr=1e30",
                         "train.min_lr_ratio=0", "train.warmup_steps=0", "train.nonfinite_patience=0",
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
                           "train.min_lr_ratio=0", "train.warmup_steps=0", "train.nonfinite_patience=3",
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


@pytest.mark.long  # 51 s: in the long tier (the default tier's 20 minutes)
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
