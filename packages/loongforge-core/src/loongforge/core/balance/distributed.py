"""Agree on cost coefficients across ranks with torch.distributed.

``fit_and_broadcast`` sums every rank's warm-up measurements (the fitters' normal equations) onto
rank ``src``, fits there once, and broadcasts the coefficients, so every rank plans with exactly
the same numbers. ``broadcast_cost_model`` sends ready coefficients from ``src`` to all. Both
are collectives: every rank of ``group`` must call them at the same point.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge.core.balance.cost import CostModel
from loongforge.core.balance.fit import CostFit, CostFitter


def _device(group) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from loongforge.core.accelerators import get_accelerator

    return get_accelerator().device()


def broadcast_cost_model(model: CostModel | None, *, src: int = 0, group=None) -> CostModel:
    """Rank ``src`` (a global rank) passes its model; every rank returns that model."""
    payload = torch.zeros(3, dtype=torch.float64, device=_device(group))
    if dist.get_rank() == src:
        if model is None:
            raise ValueError(f"broadcast_cost_model: rank {src} is the source and must pass a CostModel")
        payload.copy_(torch.tensor(model.as_tuple(), dtype=torch.float64))
    dist.broadcast(payload, src=src, group=group)
    a, b, c = payload.cpu().tolist()
    return CostModel(a=a, b=b, c=c)


def fit_and_broadcast(fitter: CostFitter, *, src: int = 0, group=None) -> CostFit:
    """Pool all ranks' measurements, fit on ``src``, and return the same CostFit on every rank.

    A fit that fails on ``src`` raises the same ValueError on every rank.
    """
    device = _device(group)
    stats = torch.tensor(fitter.statistics(), dtype=torch.float64, device=device)
    dist.reduce(stats, dst=src, group=group, op=dist.ReduceOp.SUM)
    result = torch.zeros(7, dtype=torch.float64, device=device)  # ok, a, b, c, overhead, rms, count
    message = [""]
    if dist.get_rank() == src:
        pooled = CostFitter(fit_overhead=fitter.fit_overhead)
        pooled.load_statistics(stats.cpu().numpy())
        try:
            fit = pooled.fit()
            result.copy_(torch.tensor([1.0, *fit.model.as_tuple(), fit.overhead, fit.rms_error,
                                       float(fit.num_measurements)], dtype=torch.float64))
        except ValueError as err:
            message = [str(err)]
    dist.broadcast(result, src=src, group=group)
    ok, a, b, c, overhead, rms, count = result.cpu().tolist()
    if not ok:
        dist.broadcast_object_list(message, src=src, group=group)
        raise ValueError(f"cost fit on rank {src} failed: {message[0]}")
    return CostFit(model=CostModel(a=a, b=b, c=c), overhead=overhead, rms_error=rms, num_measurements=int(count))
