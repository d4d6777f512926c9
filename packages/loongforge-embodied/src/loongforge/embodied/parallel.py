"""PyTorch-native data parallelism for policies: DDP, FSDP2 and HSDP, with per-block activation
checkpointing and torch.compile, on whatever accelerator ``loongforge.core`` selects.

Order (as in torchtitan): activation checkpointing, then ``torch.compile`` of each block, then
``fully_shard`` of each block and of the root. ``policy.blocks()`` names the repeated blocks
(vision encoder layers, joint backbone/expert layers, DiT blocks). FSDP2 uses a 1-D mesh
(``dp_shard``); HSDP a 2-D mesh (``dp_replicate`` x ``dp_shard``) that shards inside a replica
group and all-reduces across groups. Every data-parallel rank reads its own slice of the batch.

Processes join the job through ``loongforge.core.distributed.init_distributed`` with
``group_for_world_of_one=False``: a single process trains without a process group (mode ``none``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from loongforge.core.distributed import DistributedProcess
from loongforge.embodied.config import ParallelConfig

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_mode(cfg: ParallelConfig, world: int) -> str:
    mode = cfg.mode
    if mode == "auto":
        mode = "ddp" if world > 1 else "none"
    if mode == "none" and world > 1:
        raise ValueError(f"parallel.mode=none cannot run on {world} processes; use ddp, fsdp or hsdp")
    return mode


def build_mesh(mode: str, cfg: ParallelConfig, env: DistributedProcess) -> DeviceMesh | None:
    if mode == "fsdp":
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("dp_shard",))
    if mode == "hsdp":
        if env.world_size % cfg.dp_replicate:
            raise ValueError(f"parallel.dp_replicate={cfg.dp_replicate} does not divide the {env.world_size} ranks")
        return init_device_mesh(
            env.device.type, (cfg.dp_replicate, env.world_size // cfg.dp_replicate), mesh_dim_names=("dp_replicate", "dp_shard")
        )
    return None


def parallelize(policy: nn.Module, cfg: ParallelConfig, env: DistributedProcess) -> nn.Module:
    """Wrap ``policy`` (already on ``env.device``) for training; returns the module to call."""
    mode = resolve_mode(cfg, env.world_size)
    policy.activation_checkpointing = cfg.activation_checkpointing
    if cfg.compile:
        for block in policy.blocks():
            block.compile(backend=cfg.compile_backend)
    if mode == "none":
        return policy
    if mode == "ddp":
        ids = [env.device.index] if env.device.type != "cpu" and env.device.index is not None else None
        return DistributedDataParallel(policy, device_ids=ids)
    mesh = build_mesh(mode, cfg, env)
    mp = MixedPrecisionPolicy(param_dtype=DTYPE[cfg.param_dtype], reduce_dtype=DTYPE[cfg.reduce_dtype])
    for block in policy.blocks():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)
    register_fsdp_forward_method(policy, "sample_actions")
    return policy


def compute_precision(cfg: ParallelConfig, world: int, device: torch.device):
    """The forward's precision context: FSDP2/HSDP cast parameters themselves (``MixedPrecisionPolicy``);
    without them ``param_dtype=bf16`` runs the forward under bf16 autocast with fp32 parameters."""
    if cfg.param_dtype == "fp32" or resolve_mode(cfg, world) in ("fsdp", "hsdp"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPE[cfg.param_dtype])


def unwrap(model: nn.Module) -> nn.Module:
    """The policy inside a DDP wrapper (FSDP2 modifies the policy in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x)
    return x


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
