"""Data parallelism of the PyTorch-native engine: DDP, FSDP2 or HSDP over the job's data x
context-parallel ranks, plus the gradient-accumulation contexts each needs.

Gradients are reduced over every rank of the ``dp_cp`` group: ranks of one CP group hold different
tokens of the same samples, so their gradients add up just like different samples'. FSDP2 shards
each repeated block (``repeated_blocks()``) and then the part's root (embedders, heads); it keeps
parameters in ``param_dtype`` for compute and reduces gradients in fp32, and leaves the inputs'
dtypes alone (the forward runs under autocast, which casts where a model needs it and lets fp32
timestep and RoPE inputs stay fp32). HSDP is FSDP2 over a 2-D mesh: sharded inside groups of
``world / dp_replicate`` ranks, all-reduced across the ``dp_replicate`` groups.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from loongforge.core.training.torch_model import TorchModel


def data_parallel_mode(requested: str, world: int) -> str:
    """``parallel.data_parallel`` for a job whose gradient group has ``world`` ranks: ``none`` for a
    single rank (nothing to reduce), ``ddp`` for ``auto``."""
    if world == 1:
        return "none"
    return "ddp" if requested == "auto" else requested


def device_mesh(mode: str, group, device_type: str, dp_replicate: int):
    """The FSDP2 mesh of ``group``: 1-D for fsdp, (replicate, shard) for hsdp."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if mode == "fsdp":
        return DeviceMesh.from_group(group, device_type)
    world = dist.get_world_size(group)
    if world % dp_replicate:
        raise ValueError(f"parallel.dp_replicate={dp_replicate} does not divide the {world} data-parallel ranks")
    if world != dist.get_world_size():
        raise ValueError("parallel.data_parallel=hsdp needs every rank in the data-parallel group (parallel.cp=1)")
    return init_device_mesh(device_type, (dp_replicate, world // dp_replicate), mesh_dim_names=("replicate", "shard"))


def wrap(part: TorchModel, mode: str, group, device: torch.device, compute_dtype: torch.dtype,
         dp_replicate: int = 1, pure: bool = False) -> nn.Module:
    """``part`` (on ``device``, or on the meta device for FSDP) ready for data-parallel training over
    ``group``; returns the module to call. FSDP2/HSDP also shard frozen parts (they only cost
    memory); DDP leaves a part without trainable parameters alone. ``pure`` (pure bf16: the
    parameters are in the compute dtype already): FSDP2 reduces gradients in that dtype too."""
    if mode == "none":
        return part
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if not any(p.requires_grad for p in part.parameters()):
            return part
        ids = [device.index] if device.type != "cpu" and device.index is not None else None
        return DistributedDataParallel(part, process_group=group, device_ids=ids)
    if mode in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = device_mesh(mode, group, device.type, dp_replicate)
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype if pure else torch.float32,
                                  cast_forward_inputs=False)
        for block in part.repeated_blocks():
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(part, mesh=mesh, mp_policy=mp)
        for method in part.fsdp_forward_methods:
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(part, method)
        return part
    raise ValueError(f"parallel.data_parallel={mode!r}: one of ddp, fsdp, hsdp")


def is_fsdp(module: nn.Module) -> bool:
    return hasattr(module, "set_requires_gradient_sync")


def unwrap(module: nn.Module) -> nn.Module:
    """The part inside a DDP wrapper (FSDP2 modifies the part in place)."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


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


def autocast(device_type: str, dtype: torch.dtype):
    """The forward's precision: bf16 autocast unless the run is fp32 (FSDP2's parameters are
    already in the compute dtype; autocast then only casts fp32 inputs and keeps fp32 islands)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
