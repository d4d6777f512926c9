"""Process groups of the vision tower (encoder + projector), next to the foundation's.

The foundation runs on the job's layout (``init_parallel``: TP/PP/DP groups of megatron-core).
The vision tower gets its own ``ProcessGroupCollection``:

- ``encoder tp == foundation tp``: the tower is tensor-parallel in the foundation's TP group.
- ``encoder tp == 1`` (foundation tp = t > 1): every rank holds the whole tower. With
  ``split_across_foundation_tp`` the t ranks of one foundation TP group, which see the same
  micro-batch, encode disjoint shares of its images and all-gather the results (the tower is
  data-parallel across the foundation's TP group); otherwise each of them encodes all images.
- ``parallel.cp = c > 1``: the c CP ranks of a DP replica see the same micro-batch too; they
  share out its images first (then each CP rank's share is split across TP as above) and
  all-gather the features, so no image is encoded twice.

Nothing here touches megatron's module-level state: the groups are made with
``torch.distributed`` and handed to the tower's modules explicitly.

Gradients of a split tower: rank r's tower gradients cover its own images only, so they must
be summed over the TP group. The all-gather's backward hands each rank the (TP-replicated,
complete) gradient of its own rows scaled by t, and megatron's ``finalize_model_grads``
averages parameters marked ``average_gradients_across_tp_domain`` over the TP group:
(1/t) * sum_r t * g_r = sum_r g_r. Tower parameters are marked ``tensor_model_parallel=False``
so that the grad norm counts them once per TP group, as it does any replicated parameter.

Gradients of a CP-shared tower: each CP rank's loss covers its own tokens, so the features'
gradients differ between CP ranks. The CP all-gather's backward sums the gradient over the CP
group before taking the rank's rows: rank r's tower gradient is then every CP rank's loss
through its own images, and the sum over r that megatron's reduction over DP x CP takes is the
same as when every CP rank encoded every image (each with its own loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass
class VisionGroups:
    """The vision tower's groups on this rank.

    ``pgs``: the tower modules' collection (tp, pp, cp). ``split``: the group whose ranks
    share out one micro-batch's images (None: no split). ``replica``: the ranks holding the
    same tower shard (their checkpoint replicas).
    """

    pgs: ProcessGroupCollection  # the tower modules' tp, pp and cp
    tp_size: int
    split: dist.ProcessGroup | None
    replica: dist.ProcessGroup
    foundation_tp: int

    @property
    def split_size(self) -> int:
        return self.split.size() if self.split is not None else 1

    @property
    def split_rank(self) -> int:
        return self.split.rank() if self.split is not None else 0

    @property
    def replicated_across_foundation_tp(self) -> bool:
        return self.tp_size == 1 and self.foundation_tp > 1


def _singleton_group() -> dist.ProcessGroup:
    """This rank alone (every rank takes part in making the world's singleton groups)."""
    group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    return group


def build_vision_groups(ctx, encoder_tp: int, split_across_foundation_tp: bool = True) -> VisionGroups:
    """The vision tower's groups for the job ``ctx`` (a ``ParallelContext``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    foundation_tp = ctx.layout.tp
    if encoder_tp not in (1, foundation_tp):
        raise ValueError(f"parallel.encoder.tp={encoder_tp}: must be 1 or the foundation's tp ({foundation_tp})")
    pgs = ProcessGroupCollection()
    pgs.cp = ctx.pgs.cp
    # the tower is not pipelined: it lives whole on the foundation's first stage (loongforge.vlm.pipeline)
    pgs.pp = _singleton_group() if ctx.layout.pp > 1 else ctx.pgs.pp
    if encoder_tp == foundation_tp:
        pgs.tp = ctx.pgs.tp
        split = None
        replica = ctx.pgs.dp_cp
    else:
        pgs.tp = _singleton_group()
        split = ctx.pgs.tp if split_across_foundation_tp else None
        replica = ctx.pgs.tp_dp_cp
    pgs.dp_cp = replica
    return VisionGroups(pgs=pgs, tp_size=encoder_tp, split=split, replica=replica, foundation_tp=foundation_tp)


def mark_replicated_parameters(module: torch.nn.Module, groups: VisionGroups) -> None:
    """Tell megatron's grad reduction and grad norm how the tower's parameters are laid out
    (see the module doc)."""
    if not groups.replicated_across_foundation_tp:
        return
    for param in module.parameters():
        param.tensor_model_parallel = False
        if groups.split is not None:
            param.average_gradients_across_tp_domain = True


def split_items(sizes: list[int], parts: int) -> list[list[int]]:
    """Deal items (their patch counts ``sizes``) to ``parts`` ranks, largest first to the
    least-loaded rank; each rank's items keep their order. Deterministic, so every rank of the
    group computes the same shares."""
    load = [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += sizes[i]
    return [sorted(s) for s in shares]


class _GatherRows(torch.autograd.Function):
    """All-gather of per-rank row blocks of different lengths; backward returns this rank's
    rows of the incoming gradient times ``grad_scale``, after summing that gradient over the
    group with ``sum_grads`` (ranks whose gradients differ: CP ranks, each holding part of the
    loss)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], group, grad_scale: float, sum_grads: bool):
        rank = dist.get_rank(group)
        width = max(counts)
        padded = local.new_zeros((width, *local.shape[1:]))
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        ctx.start = sum(counts[:rank])
        ctx.count = counts[rank]
        ctx.grad_scale = grad_scale
        ctx.group = group if sum_grads else None
        return torch.cat([g[:n] for g, n in zip(gathered, counts)], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.group is not None:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        mine = grad[ctx.start : ctx.start + ctx.count]
        return mine * ctx.grad_scale, None, None, None, None


def gather_rows(local: torch.Tensor, counts: list[int], group, grad_scale: float = 1.0,
                sum_grads: bool = False) -> torch.Tensor:
    """Concatenate every rank's ``local`` rows (``counts[r]`` of them on rank r) in rank order
    (see ``_GatherRows`` for the gradient)."""
    return _GatherRows.apply(local, counts, group, grad_scale, sum_grads)
