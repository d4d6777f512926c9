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
import subprocess
import sys
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parent / "standin"
LF_LLM = Path(sys.executable).with_name("lf-llm")
STEPS = 3


def _start(accelerator: str, run_dir: Path, extra_env: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOONGFORGE_", "STANDIN_"))}
    env.update(OMP_NUM_THREADS="1", LOONGFORGE_ACCELERATOR=accelerator, **extra_env)
    args = [str(LF_LLM), "train", f"train.steps={STEPS}", "train.warmup_steps=1", f"log.run_dir={run_dir}",
            "log.interval=1", "checkpoint.save=false"]
    return subprocess.Popen(args, env=env, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]


@pytest.mark.slow
def test_debug_training_runs_through_the_xpu_plugin(tmp_path):
    if not LF_LLM.exists():
        pytest.skip(f"lf-llm is not installed next to {sys.executable}")
    record = tmp_path / "runtime_calls.jsonl"
    xpu_env = {"PYTHONPATH": str(STANDIN), "STANDIN_XMLIR_SERVES": "cpu", "STANDIN_XMLIR_RECORD": str(record),
               "LOONGFORGE_XPU_DEVICE_TYPE": "cpu", "LOONGFORGE_XPU_DIST_BACKEND": "gloo"}
    runs = {"xpu": _start("xpu", tmp_path / "xpu", xpu_env), "cpu": _start("cpu", tmp_path / "cpu", {})}
    out = {}
    for name, proc in runs.items():
        out[name] = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, f"{name} run failed:\n{out[name][-4000:]}"

    assert "lf-llm: llama on xpu x1" in out["xpu"]
    assert "lf-llm: llama on cpu x1" in out["cpu"]
    # the plugin imported the runtime once; on a host-device runtime every device call goes to torch.cpu
    assert [json.loads(line) for line in record.read_text().splitlines()] == [["import", "cpu"]]
    xpu, cpu = _losses(tmp_path / "xpu"), _losses(tmp_path / "cpu")
    assert len(xpu) == STEPS and all(math.isfinite(v) for v in xpu)
    assert xpu == pytest.approx(cpu, rel=1e-6, abs=0)
    assert xpu[-1] < xpu[0]
