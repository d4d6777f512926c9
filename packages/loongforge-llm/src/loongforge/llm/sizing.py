"""Sizing a model config without memory: build it on the meta device, then count parameters per
GPU for a parallel layout.

The model is built once, whole (TP=PP=EP=1, a world of one), with meta tensors: real module
structure and shapes, no storage, so DeepSeek-V3 671B builds on a laptop. megatron's own
parameter attributes then say how each tensor is placed under a layout: ``tensor_model_parallel``
parameters split over TP; routed experts (``mlp.experts.``: megatron marks them for EP only when
EP > 1) over EP x expert-TP (megatron's default expert TP is the TP size), layers over pipeline stages, the embedding on the first stage and the
output layer (or, tied, a copy of the embedding) on the last.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from loongforge.core.parallel import ParallelLayout

GIB = 1024**3
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.")


@dataclass(frozen=True)
class ParameterShape:
    name: str
    numel: int
    tensor_parallel: bool  # split over TP
    expert: bool  # a routed expert's (split over EP)
    layer: int | None  # global layer index; None outside the transformer layers
    part: str  # embedding | output | layers | final_norm


def _part(name: str) -> str:
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output"
    if LAYER.match(name):
        return "layers"
    return "final_norm"


def meta_parameters(cfg) -> list[ParameterShape]:
    """Every parameter of ``cfg``'s model, built on the meta device in a world of one."""
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.models import get_model_spec
    from loongforge.core.parallel import destroy_parallel, init_parallel

    spec = get_model_spec(cfg.family)
    ctx = init_parallel(seed=0)
    try:
        tc = TransformerConfig(**cfg.transformer_config_kwargs(), use_cpu_initialization=True,
                               perform_initialization=False, params_dtype=torch.bfloat16)
        with torch.device("meta"):
            model = spec.build(cfg, ctx, tc, True, True)
        out = []
        for name, p in model.named_parameters():
            m = LAYER.match(name)
            out.append(ParameterShape(name, p.numel(), bool(getattr(p, "tensor_model_parallel", False)),
                                      bool(ROUTED_EXPERT.search(name)), int(m.group(1)) if m else None, _part(name)))
        return out
    finally:
        destroy_parallel()


def activated_fraction(cfg) -> float:
    """The share of routed-expert parameters one token passes through (top-k of the experts)."""
    experts = getattr(cfg, "num_experts", 0)
    return cfg.moe_router_topk / experts if experts else 1.0


def default_dp(layout: ParallelLayout) -> int:
    """The smallest data-parallel size the layout allows (EP must divide DP x CP)."""
    return layout.ep // math.gcd(layout.ep, layout.cp)


def per_gpu(params: list[ParameterShape], cfg, layout: ParallelLayout, dp: int, *, precision: str = "bf16",
            distributed_optimizer: bool = False) -> dict:
    """Parameters and training-state memory of the heaviest GPU under ``layout`` x ``dp``:
    weights (bf16 or fp32), fp32 gradients (megatron DDP reduces in fp32) and Adam's state
    (fp32 master weights under bf16, first and second moments), sharded over the data-parallel
    ranks with the distributed optimizer. Activations are not included."""
    world = layout.tp * layout.pp * layout.cp * dp
    layout.validate(world)
    if cfg.num_layers % layout.pp:
        raise ValueError(f"model.num_layers={cfg.num_layers} is not divisible by parallel.pp={layout.pp}")
    expert_tp = layout.tp
    expert_dp = world // (layout.pp * layout.ep * expert_tp)
    per_stage = cfg.num_layers // layout.pp
    weight_bytes = 2 if precision == "bf16" else 4
    optimizer_bytes = 12 if precision == "bf16" else 8  # (fp32 master +) exp_avg + exp_avg_sq
    worst = None
    for stage in range(layout.pp):
        first, last = stage == 0, stage == layout.pp - 1
        dense = expert = 0
        for p in params:
            on_stage = (p.part == "embedding" and first) or (p.part in ("output", "final_norm") and last) or (
                p.part == "layers" and stage * per_stage <= p.layer < (stage + 1) * per_stage)
            if p.part == "embedding" and last and not first and cfg.tie_embeddings:
                on_stage = True  # the last stage keeps its own copy of tied embeddings
            if not on_stage:
                continue
            if p.expert:
                expert += p.numel // (layout.ep * expert_tp)
            else:
                dense += p.numel // layout.tp if p.tensor_parallel else p.numel
        shard_dense, shard_expert = (dp * layout.cp, expert_dp) if distributed_optimizer else (1, 1)
        total = dense + expert
        memory = {
            "weights": total * weight_bytes,
            "gradients": total * 4,
            "optimizer": round((dense / shard_dense + expert / shard_expert) * optimizer_bytes),
        }
        row = {"stage": stage, "parameters": total, "expert_parameters": expert, "total_bytes": sum(memory.values()),
               **{f"{k}_gib": round(v / GIB, 3) for k, v in memory.items()}, "total_gib": round(sum(memory.values()) / GIB, 3)}
        if worst is None or row["total_bytes"] > worst["total_bytes"]:
            worst = row
    return {"layout": {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep, "dp": dp, "gpus": world,
                       "expert_tp": expert_tp, "expert_dp": expert_dp},
            "precision": precision, "distributed_optimizer": distributed_optimizer, "heaviest_gpu": worst}


def size_report(cfg, layout: ParallelLayout, dp: int | None, *, precision: str, distributed_optimizer: bool) -> dict:
    """What ``lf-llm info`` prints: exact parameter counts from the meta build (total and
    activated per token) and the per-GPU memory of the layout."""
    params = meta_parameters(cfg)
    total = sum(p.numel for p in params)
    experts = sum(p.numel for p in params if p.expert)
    dp = default_dp(layout) if dp is None else dp
    return {
        "total_parameters": total,
        "activated_parameters": round(total - experts + experts * activated_fraction(cfg)),
        "expert_parameters": experts,
        **per_gpu(params, cfg, layout, dp, precision=precision, distributed_optimizer=distributed_optimizer),
        "memory_note": "weights + fp32 gradients + Adam state per GPU (activations: lf-llm info's activations entry)",
    }
