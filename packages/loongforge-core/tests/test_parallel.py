"""init_parallel: a bad layout fails before any process group; a world of one gets a private
rendezvous that leaves the rendezvous variables as it found them, and destroy_parallel leaves no
megatron state behind that breaks the next world (the MoE aux-loss scale, the attention backend a
model wrote into Transformer Engine's flags)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from loongforge.core.parallel import TE_ATTENTION_FLAGS, destroy_parallel, init_parallel

    before = dict(os.environ)
    for world in range(2):  # a second world in the same process needs no port the first one held
        ctx = init_parallel(seed=7)
        assert dist.is_initialized() and ctx.world_size == 1 and ctx.dp_size == 1, ctx
        # the first world ends with the 0-d aux-loss scale a MoE backward outside megatron's
        # schedules leaves; the schedules of the next world set a [1] scale, in place
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
        if world == 0:
            MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
            # what building a megatron model with attention_backend=unfused writes
            os.environ.update(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="0", NVTE_UNFUSED_ATTN="1")
        destroy_parallel()
        assert not any(flag in os.environ for flag in TE_ATTENTION_FLAGS), os.environ
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    leaked = {k: os.environ[k] for k in rendezvous if before.get(k) != os.environ.get(k)}
    assert not leaked, leaked
    print("ok")
""")


def run_in_fresh_cpu_process(script: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "LOONGFORGE_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_world_of_one_leaves_environment_unchanged():
    assert run_in_fresh_cpu_process(SCRIPT).strip().endswith("ok")


BAD_LAYOUT = textwrap.dedent("""
    import torch.distributed as dist
    from loongforge.core.parallel import init_parallel

    try:
        init_parallel(tp=2)
    except ValueError as exc:
        print("rejected:", exc)
    print("process group:", dist.is_initialized())
""")


def test_bad_layout_fails_before_any_process_group():
    out = run_in_fresh_cpu_process(BAD_LAYOUT)
    assert "rejected: parallel.tp=2 parallel.pp=1 parallel.cp=1: tp*pp*cp = 2 does not divide the world size 1" in out
    assert "process group: False" in out, out
