"""docs/getting-started.md's "From wheels you build" route, followed as written: its block's
commands build every wheel, make a fresh virtualenv, install ``loongforge-llm`` from the wheels and
run ``lf-llm --version``; then the guide's first run, ``lf-llm train``, shortened to two steps.

Two steps differ from the text, both stated here: the clone is this checkout (the wheels go to a
temporary ``dist/``), and ``pip install`` runs as ``uv pip install`` pinned to uv.lock's versions,
so that torch and the rest come from uv's cache rather than several GB of downloads (the wheels of
LoongForge itself still come only from ``dist/``: ``--find-links`` and ``--no-index`` for them)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "getting-started.md"


def wheel_route() -> list[str]:
    """The commands of the guide's "From wheels you build" block, comments and ``&&`` split off."""
    text = GUIDE.read_text()
    block = re.search(r"\*\*From wheels you build\.\*\*.*?```bash\n(.*?)```", text, re.S)
    assert block, f"{GUIDE}: no 'From wheels you build' block"
    commands = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        commands += [part.strip() for part in line.split("&&") if part.strip()]
    return commands


def test_the_wheel_route_is_the_one_this_test_follows():
    """The guide's block is the sequence the long test below runs (a change to one needs the other)."""
    assert wheel_route() == [
        "git clone https://github.com/loongforge/loongforge", "cd loongforge",
        "uv build --all-packages --wheel -o dist/",
        "python -m venv /tmp/lf", ". /tmp/lf/bin/activate",
        "pip install --find-links dist/ loongforge-llm",
        "lf-llm --version",
    ]


@pytest.mark.long  # builds seven wheels and installs torch & co into a fresh venv (from uv's cache): minutes
@pytest.mark.timeout(1800)
def test_getting_started_from_built_wheels_in_a_fresh_venv(tmp_path):
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        pytest.skip("uv not found")
    venv, dist = tmp_path / "lf", tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(LOONGFORGE_CACHE=str(tmp_path / "cache"), UV_PYTHON_DOWNLOADS="never")

    def run(argv: list[str], cwd: Path = ROOT, timeout: float = 900) -> str:
        out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout

    pins = tmp_path / "pins.txt"  # uv.lock's versions of everything but the workspace packages
    run([uv, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--all-packages", "--no-dev",
         "-o", str(pins)])
    for command in wheel_route():
        argv = shlex.split(command.replace("dist/", f"{dist}/").replace("/tmp/lf", str(venv)))
        if argv[0] in ("git", "cd", "."):  # the clone is this checkout; activation is PATH below
            continue
        if argv[0] == "uv":
            run([uv, *argv[1:]])
        elif argv[0] == "python":
            run([sys.executable, *argv[1:]])
            env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
        elif argv[0] == "pip":
            run([uv, "pip", "install", "--python", str(venv / "bin" / "python"), "-c", str(pins),
                 *argv[2:]])
        else:
            version = run(argv, cwd=tmp_path)
            assert "loongforge-llm 0.1.0" in version and "loongforge-core 0.1.0" in version, version
    site = run([str(venv / "bin" / "python"), "-c", "import loongforge.llm, loongforge.core; "
                "print(loongforge.llm.__file__); print(loongforge.core.__file__)"])
    assert str(ROOT) not in site and str(venv) in site, site  # the wheels, not the checkout
    run(["lf-llm", "train", "train.steps=2"], cwd=tmp_path)  # "lf-llm train", the guide's first run
    records = [json.loads(line) for line in (tmp_path / "runs" / "llm-debug" / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] == 2, records
    assert (tmp_path / "runs" / "llm-debug" / "config.yaml").is_file()
