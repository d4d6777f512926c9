"""The four CLIs explain themselves: ``--version``, ``env``, ``configs``, and ``train --help``
listing every key of the run config's dataclasses with its type, the value the run would use and a
description; ``train --print-config`` prints the resolved config. The commands that need no torch
import none of the heavy libraries."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing

import pytest
import yaml

from loongforge.core.config_docs import describe_schema
from loongforge.diffusion.cli import describe_cli as diffusion_cli
from loongforge.diffusion.cli import main as lf_diffusion
from loongforge.embodied.cli import describe_cli as embodied_cli
from loongforge.embodied.cli import main as lf_embodied
from loongforge.llm.cli import describe_cli as llm_cli
from loongforge.llm.cli import main as lf_llm
from loongforge.vlm.cli import describe_cli as vlm_cli
from loongforge.vlm.cli import main as lf_vlm

CLIS = {"lf-llm": (lf_llm, llm_cli), "lf-vlm": (lf_vlm, vlm_cli), "lf-diffusion": (lf_diffusion, diffusion_cli),
        "lf-embodied": (lf_embodied, embodied_cli)}


def output(capsys, main, *argv: str) -> str:
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's --help and --version
        code = exc.code
    assert code == 0
    return capsys.readouterr().out


def leaf_keys(schema: type, prefix: str = "") -> set[str]:
    """Every leaf key, walked independently of ``config_docs``."""
    keys = set()
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        nested = tp if dataclasses.is_dataclass(tp) else type(default) if dataclasses.is_dataclass(default) else None
        keys |= leaf_keys(nested, f"{prefix}{f.name}.") if nested else {f"{prefix}{f.name}"}
    return keys


def key_lines(text: str) -> dict[str, str]:
    """``train --help``'s key listing: ``{key: its line}``."""
    return {m.group(1): line for line in text.splitlines() if (m := re.match(r"  (\S+) \(.+\) = ", line))}


@pytest.mark.parametrize("cli", list(CLIS))
def test_train_help_lists_every_key_with_type_value_and_help(cli, capsys):
    main, describe = CLIS[cli]
    app = describe()
    cfg = app.load_config(app.default_config, [])
    text = output(capsys, main, "train", "--help")
    keys = leaf_keys(type(cfg)) - set(getattr(type(cfg), "UNSETTABLE", {}))
    assert {"train.lr", "train.steps", "parallel.timeout_s", "checkpoint.interval", "log.run_dir"} <= keys
    listed = key_lines(text)
    assert keys <= set(listed), sorted(keys - set(listed))
    assert not set(getattr(type(cfg), "UNSETTABLE", {})) & set(listed)
    assert [key for key in keys if "  -- " not in listed[key]] == []  # every key has a help text
    assert "  train.lr (float) = " in text and "peak learning rate" in text
    assert "  train.nonfinite_patience (int) = 1  -- " in text
    assert "shipped configs:" in text and "--print-config" in text
    # the values are the default config's, not the dataclass defaults
    assert f"  train.steps (int) = {cfg.train.steps}  -- " in text
    assert f"  log.run_dir (str) = {cfg.log.run_dir!r}  -- " in text


def test_train_help_shows_the_chosen_config_and_marks_overrides(capsys):
    default = key_lines(output(capsys, lf_llm, "train", "--help"))
    assert default["train.steps"].startswith("  train.steps (int) = 80  ")
    assert "train.lr (float) = 0.003" in default["train.lr"] and "'runs/llm-debug'" in default["log.run_dir"]
    sft = key_lines(output(capsys, lf_llm, "train", "--config", "sft_debug", "--help", "train.steps=3"))
    assert sft["recipe"].startswith("  recipe (str) = 'sft'")
    assert "train.steps (int) = 3  [override; was 40]" in sft["train.steps"]
    assert "[override" not in sft["train.lr"]


@pytest.mark.parametrize("cli", list(CLIS))
def test_print_config_prints_the_resolved_config_and_trains_nothing(cli, capsys, tmp_path):
    main, describe = CLIS[cli]
    text = output(capsys, main, "train", "--print-config", "train.steps=7", f"log.run_dir={tmp_path / 'run'}")
    printed = yaml.safe_load(text)
    assert printed["train"]["steps"] == 7 and printed["log"]["run_dir"] == str(tmp_path / "run")
    app = describe()
    assert set(printed) == {f.name for f in dataclasses.fields(type(app.load_config(app.default_config, [])))}
    assert not (tmp_path / "run").exists()


HEAVY = ("torch", "megatron", "transformers", "diffusers", "lerobot")
PROBE = """
import contextlib, io, sys, time
start = time.perf_counter()
from loongforge.{name}.cli import main
took = []
for argv in (["--version"], ["--help"], ["configs"], ["env"], ["plot", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            assert main(argv) == 0, argv
        except SystemExit as exc:
            assert exc.code == 0, (argv, exc.code)
    took.append(time.perf_counter() - start)  # the first includes importing the CLI
    start = time.perf_counter()
print(sorted(m for m in {heavy} if m in sys.modules))
print(max(took))
"""


@pytest.mark.parametrize("cli", list(CLIS))
def test_commands_that_need_no_torch_import_none(cli):
    """``--version``, ``--help``, ``configs``, ``env`` (and a command's own ``--help``) import neither
    torch, megatron-core, transformers, diffusers nor lerobot, so each answers at once (well under
    2 s here: the probe prints the slowest, the first one's time including importing the CLI; a
    speed is not asserted in a test)."""
    name = cli.removeprefix("lf-")
    probe = PROBE.format(name=name, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported, slowest = out.stdout.split("\n")[:2]
    assert imported == "[]", out.stdout
    assert float(slowest) > 0, out.stdout
    assert "cpp_extension" not in out.stderr and "Traceback" not in out.stderr


def test_env_reports_the_gpus_nvidia_smi_lists(tmp_path):
    """``env`` asks ``nvidia-smi`` (where it is on PATH) for the GPUs, and says which accelerator a
    run would use from ``LOONGFORGE_ACCELERATOR`` and what it found, without importing torch."""
    import os

    from loongforge.core.environment import torch_cuda_build

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559 MiB'\necho 'NVIDIA H100 80GB HBM3, 81559 MiB'\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "LOONGFORGE_ACCELERATOR"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env.get('PATH', '')}"
    run = [sys.executable, "-c", "from loongforge.llm.cli import main; main(['env'])"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, env=env).stdout
    assert "NVIDIA GPUs: 2: NVIDIA H100 80GB HBM3, 81559 MiB; NVIDIA H100 80GB HBM3, 81559 MiB" in out, out
    expected = "accelerator in use: cuda" if torch_cuda_build() else "accelerator in use: cpu"
    assert expected in out, out
    out = subprocess.run(run, capture_output=True, text=True, timeout=60,
                         env={**env, "LOONGFORGE_ACCELERATOR": "nope"}).stdout
    assert "accelerator in use: nope (set by LOONGFORGE_ACCELERATOR) (not installed" in out, out


@pytest.mark.parametrize("cli", list(CLIS))
def test_version_env_and_configs(cli, capsys):
    main, describe = CLIS[cli]
    app = describe()
    version = output(capsys, main, "--version")
    assert all(f"{name} 0.1.0" in version for name in app.packages if name.startswith("loongforge-"))
    env = output(capsys, main, "env")
    for key in ("python:", "torch:", "triton:", "torch CUDA build:", "NVIDIA GPUs:", "accelerator plugins: cpu (loongforge-core",
                "accelerator in use: cpu", "kernel providers:", "ops defined:"):
        assert key in env, env
    configs = output(capsys, main, "configs")
    names = [line.split()[0] for line in configs.splitlines() if line and not line.startswith(cli)]
    assert app.default_config in names
    assert all(len(line.split(None, 1)) == 2 for line in configs.splitlines() if line.split() and line.split()[0] in names)


def test_config_docs_reads_descriptions_from_the_dataclass_source():
    @dataclasses.dataclass
    class Example:
        plain: int = 1  # a trailing comment
        # a comment above,
        # over two lines
        above: str = "x#y"
        nothing: float | None = None

    docs = {d.key: d for d in describe_schema(Example)}
    assert docs["plain"].help == "a trailing comment" and docs["plain"].default == "1"
    assert docs["above"].help == "a comment above, over two lines" and docs["above"].default == "'x#y'"
    assert docs["nothing"].help == "" and docs["nothing"].type == "float | null" and docs["nothing"].default == "null"


@dataclasses.dataclass
class _Group:
    steps: int = 100  # optimizer steps
    name: str = "base"


@dataclasses.dataclass
class _Family(_Group):
    extra: bool = False  # a key only this family has


@dataclasses.dataclass
class _Run:
    group: _Group = dataclasses.field(default_factory=lambda: _Group(steps=60))
    family: _Group = dataclasses.field(default_factory=lambda: _Family(name="fam"))


def test_config_docs_takes_a_groups_defaults_from_its_parent():
    from loongforge.core.config_docs import describe_fields

    docs = {d.key: d for d in describe_schema(_Run)}
    assert docs["group.steps"].default == "60" and docs["group.steps"].value == 60
    assert docs["group.steps"].help == "optimizer steps"
    # a family's subclass as default is described as the annotated base, with the subclass's values
    assert docs["family.name"].default == "'fam'" and "family.extra" not in docs
    added = describe_fields(_Family, _Family(), "family.", skip={f.name for f in dataclasses.fields(_Group)})
    assert [(d.key, d.type, d.value, d.help) for d in added] == [("family.extra", "bool", False, "a key only this family has")]


@pytest.mark.parametrize("cli", list(CLIS))
def test_configs_describes_each_config_in_whole_sentences(cli, capsys):
    text = output(capsys, CLIS[cli][0], "configs")
    described = [line.split(None, 1)[1] for line in text.splitlines()
                 if line and not line.startswith((cli, "for "))]
    assert described and not [d for d in described if d.endswith((":", ",", ";", " on", " and"))], described


def test_a_config_of_another_command_is_listed_apart_and_refused_by_train(capsys, tmp_path):
    """lf-diffusion's ``preprocess`` config is ``lf-diffusion preprocess``'s, not a training config."""
    text = output(capsys, lf_diffusion, "configs")
    assert "for lf-diffusion preprocess: preprocess  " in text
    assert not any(line.startswith("preprocess ") for line in text.splitlines())
    assert "preprocess" not in output(capsys, lf_diffusion, "--help").split("shipped configs:")[1].splitlines()[0]
    assert lf_diffusion(["train", "--config", "preprocess", f"log.run_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --config preprocess: a config of `lf-diffusion preprocess`, not of `lf-diffusion train` "
                   "(see `lf-diffusion configs`)")


def test_llm_bench_defaults_to_the_debug_config_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the default is the GPU case")
    assert lf_llm(["bench", "--variant", "x=train.lr"]) == 2  # refused before any run, after the default is chosen
    out = capsys.readouterr()
    assert "lf-llm bench: no GPU here: --config train_debug (on a GPU the default is train_0_5b)" in out.out
    assert "'train.lr' is not of the form key=value" in out.err
