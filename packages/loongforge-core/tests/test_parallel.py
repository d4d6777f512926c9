"""init_parallel for a world of one: a private rendezvous that leaves the rendezvous variables as it found them,
and destroy_parallel leaves no megatron state behind that breaks the next world (the MoE aux-loss scale, the
attention backend a model wrote into Transformer Engine's flags)."""

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


def test_world_of_one_leaves_environment_unchanged():
    env = {"PATH": "/usr/bin:/bin", "LOONGFORGE_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-4000:]
