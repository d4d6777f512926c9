"""Data parallelism for the DiT: DDP or FSDP2 over the data x context-parallel ranks.

Gradients are reduced over every rank of the job (``dp_cp`` group): ranks of one CP group hold
different tokens of the same samples, so their gradients add up just like different samples'.
FSDP2 shards each transformer block and the root (embedders, output head) separately and
computes in ``param_dtype`` with fp32 gradient reduction.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from loongforge.diffusion.model.dit import WanDiT


def wrap(model: WanDiT, engine: str, group, device_type: str, compute_dtype: torch.dtype) -> nn.Module:
    """``model`` ready for data-parallel training over ``group`` (itself for a group of one).
    FSDP2 also shards frozen experts (they only cost memory); DDP leaves them alone."""
    if group is None or dist.get_world_size(group) == 1:
        return model
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if not any(p.requires_grad for p in model.parameters()):
            return model  # a frozen expert: nothing to reduce
        return DistributedDataParallel(model, process_group=group)
    if engine == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(group, device_type)
        # inputs keep their dtypes: timesteps and RoPE tables must stay fp32 (WanDiT casts activations)
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    raise ValueError(f"train.data_parallel={engine!r}: one of ddp, fsdp2")


def is_fsdp(module: nn.Module) -> bool:
    return hasattr(module, "set_requires_gradient_sync")


@contextlib.contextmanager
def accumulation(module: nn.Module, uneven: bool):
    """Around one step's micro-batches. When DP ranks run different numbers of micro-batches,
    FSDP2 keeps each rank's parameters gathered from its first forward to its last backward, so
    every rank issues the same collectives (one all-gather and one reduce-scatter per block)."""
    if not (uneven and is_fsdp(module)):
        yield
        return
    module.set_reshard_after_forward(False)
    try:
        yield
    finally:
        module.set_reshard_after_forward(True)
        module.set_reshard_after_forward(False, recurse=False)  # the root's default


@contextlib.contextmanager
def gradient_sync(module: nn.Module, sync: bool):
    """Accumulate without reducing unless ``sync`` (the last micro-batch of a step); under FSDP2
    the parameters also stay gathered between accumulation micro-batches."""
    if is_fsdp(module):
        module.set_requires_gradient_sync(sync)
        module.set_reshard_after_backward(sync)
        yield
    elif sync or not hasattr(module, "no_sync"):
        yield
    else:
        with module.no_sync():
            yield


def autocast(module: nn.Module, device_type: str, dtype: torch.dtype):
    """Autocast for DDP/plain modules in bf16; FSDP2 casts through its mixed-precision policy."""
    if dtype == torch.float32 or is_fsdp(module):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
