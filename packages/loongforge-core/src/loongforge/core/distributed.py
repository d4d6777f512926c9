"""How a process joins a distributed job: torch.distributed on the accelerator ``loongforge.core`` selects.

``init_distributed`` reads this process's place in the job from the ``torchrun`` environment
(``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``; a plain ``python`` process is a world of one), makes the
accelerator's device for its local rank the current one, and initialises torch.distributed on the
accelerator's collective backend (gloo on CPU, nccl on CUDA). It imports no megatron and installs
no megatron adaptation: ``loongforge.core.parallel.init_parallel`` builds megatron-core's groups on
top of it, and PyTorch-native engines (DDP, FSDP2) use it as it is.

A world of one gets a process group only when the caller asks (``group_for_world_of_one``):
megatron-core needs one even for a single process, while PyTorch-native code runs a single process
without one. Such a group, started without a launcher, rendezvous on a private store, so nothing is
written into ``os.environ`` that a process started later could inherit.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from loongforge.core.accelerators import Accelerator, get_accelerator


@dataclass(frozen=True)
class DistributedProcess:
    """This process's place in the job and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    accelerator: Accelerator

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_size_from_env() -> int:
    """The job's number of processes, as ``torchrun`` sets it (1 without a launcher)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1:
        raise ValueError(f"WORLD_SIZE={world_size}: must be at least 1")
    return world_size


def _rank_from_env(world_size: int) -> int:
    """This process's global rank, as ``torchrun`` sets it (0 without a launcher)."""
    rank = int(os.environ.get("RANK", "0"))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank}: must be in [0, WORLD_SIZE={world_size})")
    return rank


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now (for a job's rendezvous on one host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(*, group_for_world_of_one: bool, accelerator: Accelerator | None = None,
                     timeout_s: float | None = None) -> DistributedProcess:
    """Join the job this process was launched into and pick its device.

    A process group on ``accelerator.dist_backend`` is made when the world has more than one
    process, or when ``group_for_world_of_one`` is true; a group that already exists is used as it is.
    The environment is checked before any group is made. Rank and world size are the group's
    where there is one, else those of the environment. ``timeout_s``: how long the rendezvous and
    every collective of the group may wait for the other ranks (None: torch's default).
    """
    world_size = world_size_from_env()
    rank = _rank_from_env(world_size)
    accel = accelerator or get_accelerator()
    local_rank = accel.local_rank()
    device = accel.device(local_rank)
    accel.set_device(device)

    if not dist.is_initialized() and (world_size > 1 or group_for_world_of_one):
        kwargs = {"device_id": device} if device.type != "cpu" else {}
        if timeout_s is not None:
            kwargs["timeout"] = timedelta(seconds=timeout_s)
        if world_size == 1 and "MASTER_ADDR" not in os.environ:
            kwargs["init_method"] = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group(backend=accel.dist_backend, world_size=world_size, rank=rank, **kwargs)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return DistributedProcess(rank=rank, world_size=world_size, local_rank=local_rank, device=device, accelerator=accel)


def collective_failure(exc: BaseException) -> str | None:
    """One line for ``exc`` when it is the job's communication failing (a rendezvous or collective
    timed out, a peer's connection closed: another rank died or stalled), else None."""
    text = str(exc).strip()
    if not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport" in text)):
        return None
    first = text.splitlines()[0] if text else type(exc).__name__
    first = first.split("] ", 1)[-1] if first.startswith("[") else first  # drop gloo's source location
    return (f"communication with the other ranks failed: {first} (another rank failed, was killed or stalled: "
            f"see its output; parallel.timeout_s bounds every wait)")
