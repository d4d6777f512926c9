"""Each CPU adaptation of megatron-core is needed: the scenario passes with all of them and
fails with any one left out."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loongforge.core.accelerators.cpu_megatron import ADAPTATIONS, SKIP_ENV

SCENARIO = Path(__file__).with_name("megatron_cpu_scenario.py")


# the MoE split sizes only reach gloo's all_to_all when tokens cross expert-parallel ranks
NEEDS_EP2 = {"moe_split_sizes"}


def run(skip: str = "", ep: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, SKIP_ENV: skip, "OMP_NUM_THREADS": "1", "LOONGFORGE_ACCELERATOR": "cpu", "SCENARIO_EP": str(ep)}
    cmd = [sys.executable, str(SCENARIO)]
    if ep > 1:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={ep}", str(SCENARIO)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("ep", [1, 2])
def test_scenario_runs_with_all_adaptations(ep):
    proc = run(ep=ep)
    assert proc.returncode == 0 and "SCENARIO OK" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.parametrize("name", sorted(ADAPTATIONS))
def test_each_adaptation_is_needed(name):
    proc = run(name, ep=2 if name in NEEDS_EP2 else 1)
    assert proc.returncode != 0, f"megatron ran on CPU without the {name!r} adaptation: it is not needed"
    assert "SCENARIO OK" not in proc.stdout


def test_unknown_skip_name_is_rejected():
    proc = run("no_such_adaptation")
    assert proc.returncode != 0 and "no_such_adaptation" in proc.stderr


def test_device_context_still_places_factories():
    """After the adaptations, ``with torch.device("meta")`` still creates every factory's tensor on
    the meta device (transformers' from_pretrained builds models this way, then fills them)."""
    script = (
        "import torch\n"
        "from loongforge.core.accelerators.cpu_megatron import install\n"
        "install()\n"
        "with torch.device('meta'):\n"
        "    made = [torch.tensor([1.0]), torch.zeros(2), torch.arange(3), torch.empty(1), torch.ones(1),\n"
        "            torch.as_tensor([1.0]), torch.full((1,), 2.0)]\n"
        "print(sorted({t.device.type for t in made}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "LOONGFORGE_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "['meta']"
