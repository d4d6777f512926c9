"""init_distributed in a world of one (each case in a fresh process, started without a launcher): the
device and rank it reports, a process group only when asked for, no megatron imported, and a bad
environment rejected before any process group exists."""

from __future__ import annotations

import subprocess
import sys
import textwrap

ENV = {"PATH": "/usr/bin:/bin", "LOONGFORGE_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

WORLD_OF_ONE = textwrap.dedent("""
    import dataclasses
    import os
    import sys
    import torch
    import torch.distributed as dist
    from loongforge.core.distributed import init_distributed

    before = dict(os.environ)
    alone = init_distributed(group_for_world_of_one=False)
    assert not dist.is_initialized()
    assert (alone.rank, alone.world_size, alone.local_rank, alone.is_main) == (0, 1, 0, True), alone
    assert alone.device == torch.device("cpu") and alone.accelerator.name == "cpu", alone
    try:
        alone.rank = 1
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("DistributedProcess is not frozen")

    grouped = init_distributed(group_for_world_of_one=True)
    assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert grouped == alone, (grouped, alone)
    assert init_distributed(group_for_world_of_one=True) == grouped  # joins the existing group
    dist.destroy_process_group()

    assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
    megatron = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
    assert not megatron, megatron
    print("ok")
""")

BAD_RANK = textwrap.dedent("""
    import torch.distributed as dist
    from loongforge.core.distributed import init_distributed

    try:
        init_distributed(group_for_world_of_one=True)
    except ValueError as exc:
        assert "RANK=2" in str(exc), exc
    else:
        raise AssertionError("RANK=2 of WORLD_SIZE=2 was accepted")
    assert not dist.is_initialized()
    print("ok")
""")


def run(script: str, **env: str) -> None:
    proc = subprocess.run([sys.executable, "-c", script], env={**ENV, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-4000:]


def test_world_of_one_groups_only_when_asked_and_imports_no_megatron():
    run(WORLD_OF_ONE)


def test_rank_outside_the_world_fails_before_any_process_group():
    run(BAD_RANK, WORLD_SIZE="2", RANK="2")
