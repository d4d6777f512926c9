"""``lf-llm train`` selects the xpu plugin by ``LOONGFORGE_ACCELERATOR=xpu`` alone.

The Kunlunxin runtime is replaced by the stand-in (``standin/torch_xmlir``) in its ``cpu`` role:
a runtime whose device is the host and whose collectives run on gloo, which the plugin is told
through its two documented settings. The debug run goes through the whole stack unchanged:
accelerator selection by entry point, the lazy vendor import, the plugin's device and backend
naming, its megatron adaptations, process groups, the trainer. It is compared with the same run
on the built-in cpu accelerator.

What this proves: no code outside loongforge-xpu knows about the plugin, and a run through it
gives exactly the losses of the cpu run. What it does not prove: anything about a real Kunlun
device. On xpytorch builds the plugin serves ``cuda``/``nccl``, a path this host cannot execute
(the contract tests check that path's calls against the recording stand-in instead).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parent / "standin"
LF_LLM = Path(sys.executable).with_name("lf-llm")
STEPS = 3
_runs: dict[str, subprocess.Popen] = {}
_root: list[Path] = []


def _start(accelerator: str, run_dir: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOONGFORGE_", "STANDIN_"))}
    env.update(OMP_NUM_THREADS="1", LOONGFORGE_ACCELERATOR=accelerator, **extra_env)
    args = [str(LF_LLM), "train", f"train.steps={STEPS}", "train.warmup_steps=1", f"log.run_dir={run_dir}",
            "log.interval=1", "checkpoint.save=false"]
    with open(run_dir.parent / f"{accelerator}.log", "w") as log:  # a file, not a pipe: read only when the test runs
        return subprocess.Popen(args, env=env, cwd=run_dir.parent, stdout=log, stderr=subprocess.STDOUT)


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]


def start_background_runs() -> None:
    """Start the xpu run and the cpu reference run side by side; conftest.py calls this after collection."""
    if _runs or not LF_LLM.exists():
        return
    root = Path(tempfile.mkdtemp(prefix="loongforge-xpu-train-"))
    _root.append(root)
    xpu_env = {"PYTHONPATH": str(STANDIN), "STANDIN_XMLIR_SERVES": "cpu",
               "STANDIN_XMLIR_RECORD": str(root / "runtime_calls.jsonl"),
               "LOONGFORGE_XPU_DEVICE_TYPE": "cpu", "LOONGFORGE_XPU_DIST_BACKEND": "gloo"}
    _runs.update(xpu=_start("xpu", root / "xpu", xpu_env), cpu=_start("cpu", root / "cpu", {}))


@pytest.mark.slow
def test_debug_training_runs_through_the_xpu_plugin():
    if not LF_LLM.exists():
        pytest.skip(f"lf-llm is not installed next to {sys.executable}")
    start_background_runs()
    root = _root[0]
    try:
        out = {}
        for name, proc in _runs.items():
            proc.wait(timeout=300)
            out[name] = (root / f"{name}.log").read_text()
            assert proc.returncode == 0, f"{name} run failed:\n{out[name][-4000:]}"

        assert "lf-llm: llama on xpu x1" in out["xpu"]
        assert "lf-llm: llama on cpu x1" in out["cpu"]
        # the plugin imported the runtime once; on a host-device runtime every device call goes to torch.cpu
        calls = [json.loads(line) for line in (root / "runtime_calls.jsonl").read_text().splitlines()]
        assert calls == [["import", "cpu"]]
        xpu, cpu = _losses(root / "xpu"), _losses(root / "cpu")
        assert len(xpu) == STEPS and all(math.isfinite(v) for v in xpu)
        assert xpu == pytest.approx(cpu, rel=1e-6, abs=0)
        assert xpu[-1] < xpu[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
