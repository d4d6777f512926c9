"""Process groups for one training job, built once for the engine that runs it.

``init_parallel`` validates the layout against the world size *before* any process group is
made and joins the job through ``loongforge.core.distributed.init_distributed`` (torch.distributed
on the accelerator's backend: gloo on CPU, nccl on CUDA; a world of one gets a group too). Then,
for the megatron-core engine (``engine="megatron"``), it installs the accelerator's megatron-core
adaptations, builds megatron's TP/PP/CP/EP/DP groups (``megatron.core.parallel_state``) and seeds the
TP-aware RNG tracker; for the PyTorch-native engine (``engine="torch"``) it builds a torch
``DeviceMesh`` of ``(dp, cp)`` and imports no megatron. Either way it returns an explicit
``ParallelContext`` whose ``pgs`` (megatron-core's ``ProcessGroupCollection``, or ``MeshGroups``
of the mesh) is what models and optimizers receive. Launch with ``torchrun`` for one or many nodes;
a plain ``python`` process is a world of one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from loongforge.core.accelerators import Accelerator, get_accelerator
from loongforge.core.config import ConfigError
from loongforge.core.distributed import init_distributed, world_size_from_env
from loongforge.core.kernels.policy import KernelPolicy

TE_ATTENTION_FLAGS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")

__all__ = ["ParallelLayout", "ParallelContext", "MeshGroups", "init_parallel", "destroy_parallel"]


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes; data parallel is what the world size leaves over."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def data_parallel_size(self, world_size: int) -> int:
        self.validate(world_size)
        return world_size // (self.tp * self.pp * self.cp)

    def validate(self, world_size: int) -> None:
        for key in ("tp", "pp", "cp", "ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{key}={value!r}: must be a positive integer")
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ConfigError(
                f"parallel.tp={self.tp} parallel.pp={self.pp} parallel.cp={self.cp}: tp*pp*cp = {model_parallel} does "
                f"not divide the world size {world_size} (processes started, e.g. torchrun --nproc-per-node N)"
            )
        dp = world_size // model_parallel
        if (dp * self.cp) % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} must divide dp*cp = {dp * self.cp} (world size {world_size})")


class SingleRank:
    """The tensor- or pipeline-parallel "group" of a layout without that parallelism: this rank alone."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@dataclass(frozen=True)
class MeshGroups:
    """The PyTorch-native engine's groups, from a torch ``DeviceMesh`` of ``(dp, cp)``: the same
    attribute names as megatron-core's ``ProcessGroupCollection`` (``dp``, ``cp``, ``dp_cp``; ``tp``
    and ``pp`` are this rank alone), with the ranks of one CP group adjacent, as megatron orders them."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh, dims ("dp", "cp")
    dp: object
    cp: object
    dp_cp: object
    tp: SingleRank = field(default_factory=SingleRank)
    pp: SingleRank = field(default_factory=SingleRank)


def mesh_groups(device_type: str, world_size: int, cp: int) -> MeshGroups:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=("dp", "cp"))
    return MeshGroups(mesh=mesh, dp=mesh.get_group("dp"), cp=mesh.get_group("cp"), dp_cp=dist.group.WORLD)


@dataclass
class ParallelContext:
    """What one process knows about the job's layout."""

    layout: ParallelLayout
    accelerator: Accelerator
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    dp_size: int
    pgs: Any  # megatron.core.process_groups_config.ProcessGroupCollection, or MeshGroups (torch engine)
    # how the modules built with this context choose their registry ops (a task's build_model
    # hands its own to the family's build with dataclasses.replace)
    kernels: KernelPolicy = field(default_factory=KernelPolicy)

    @property
    def tp_rank(self) -> int:
        return self.pgs.tp.rank()

    @property
    def pp_rank(self) -> int:
        return self.pgs.pp.rank()

    @property
    def dp_rank(self) -> int:
        return self.pgs.dp.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    *,
    seed: int = 1234,
    accelerator: Accelerator | None = None,
    timeout_s: float | None = None,
    engine: str = "megatron",
) -> ParallelContext:
    """The process groups of one layout for ``engine`` (``"megatron"`` or ``"torch"``; see the module doc)."""
    layout = ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep)
    world_size = world_size_from_env()
    layout.validate(world_size)  # before any process group exists
    if engine not in ("megatron", "torch"):
        raise ValueError(f"engine={engine!r}: megatron or torch")
    if engine == "torch" and (tp, pp, ep) != (1, 1, 1):
        raise ConfigError(f"parallel.tp={tp} parallel.pp={pp} parallel.ep={ep}: the PyTorch-native engine shards "
                          f"data and context only (tp, pp and ep must be 1)")

    accel = accelerator or get_accelerator()
    if engine == "torch":
        process = init_distributed(group_for_world_of_one=True, accelerator=accel, timeout_s=timeout_s)
        accel.manual_seed(seed)
        return ParallelContext(layout=layout, accelerator=accel, device=process.device, rank=process.rank,
                               world_size=process.world_size, local_rank=process.local_rank,
                               dp_size=layout.data_parallel_size(process.world_size),
                               pgs=mesh_groups(process.device.type, process.world_size, cp))
    accel.install_megatron_adaptations()
    process = init_distributed(group_for_world_of_one=True, accelerator=accel, timeout_s=timeout_s)

    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    accel.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return ParallelContext(
        layout=layout,
        accelerator=accel,
        device=process.device,
        rank=process.rank,
        world_size=process.world_size,
        local_rank=process.local_rank,
        dp_size=layout.data_parallel_size(process.world_size),
        pgs=ProcessGroupCollection.use_mpu_process_groups(),
    )


def destroy_parallel() -> None:
    """Tear down the world of :func:`init_parallel`, so that the process can build another."""
    if "megatron.core.parallel_state" not in sys.modules:  # a torch-engine world: no megatron state to reset
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    # megatron keeps the MoE aux-loss gradient scale of the last backward in a class attribute and
    # later copies new scales into it in place. A MoE backward outside megatron's schedules stores a
    # 0-d tensor there, the schedules pass shape [1], and the copy fails: the next world starts
    # without one, as a fresh process would.
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    # megatron writes a model's attention backend into Transformer Engine's flags (the process
    # environment) and refuses a later model whose backend differs from them: the next world's
    # models choose their own, as in a fresh process
    for flag in TE_ATTENTION_FLAGS:
        os.environ.pop(flag, None)
