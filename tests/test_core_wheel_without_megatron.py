"""loongforge-core alone: its wheel installed in a fresh venv pulls no megatron-core, and the first
example of its README (the PyTorch-native engine's process groups and a checkpoint) runs there."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "packages" / "loongforge-core" / "README.md"


def readme_example() -> str:
    """The first Python block of the README's "Use it from your own code"."""
    section = README.read_text().split("## Use it from your own code", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, f"{README}: no Python example"
    return block.group(1)


def test_the_readme_example_needs_no_megatron():
    assert "engine=\"torch\"" in readme_example() and "megatron" not in readme_example()


@pytest.mark.long  # builds the core wheel and installs torch & co into a fresh venv (from uv's cache)
@pytest.mark.timeout(1800)
def test_the_core_wheel_installs_and_runs_without_megatron(tmp_path):
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        pytest.skip("uv not found")
    venv, dist = tmp_path / "venv", tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(LOONGFORGE_CACHE=str(tmp_path / "cache"), UV_PYTHON_DOWNLOADS="never")

    def run(argv: list[str], cwd: Path = ROOT) -> str:
        out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout

    pins = tmp_path / "pins.txt"  # uv.lock's versions, so that torch comes from uv's cache
    run([uv, "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--all-packages", "--no-dev", "-o", str(pins)])
    run([uv, "build", "--package", "loongforge-core", "--wheel", "-o", str(dist)])
    run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    run([uv, "pip", "install", "--python", python, "-c", str(pins), "--find-links", str(dist), "loongforge-core"])
    installed = run([uv, "pip", "list", "--python", python, "--format", "freeze"]).lower()
    assert "loongforge-core==" in installed and "megatron" not in installed, installed
    (tmp_path / "example.py").write_text(readme_example())
    run([python, "example.py"], cwd=tmp_path)
    assert (tmp_path / "ckpt" / "latest").is_file()
