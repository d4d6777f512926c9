"""Activation memory of a training step, measured rather than modelled.

What a layer keeps for its backward depends on the implementation (fused or reference RoPE, the
attention kernel, recomputation, the MoE dispatcher), so instead of a formula ``lf-llm info``
runs a *proxy*: the config's model with one layer of each kind it has (dense, MoE), the
config's widths, heads and recomputation, routed experts cut to the top-k (a token's activations
depend on how many experts it visits, not on how many exist), a small vocabulary, in bf16 on the
CPU. One forward and backward at each of three token counts, under ``saved_tensors_hooks``, counts the
bytes each layer saves for its backward (``saved_bytes``, each tensor once; parameters not
counted); three token counts give a fixed part, bytes per token and a per-token-squared term (where
attention materialises its scores). The layout then scales it:

- tokens of one micro-batch on a rank: ``micro_batch_size * seq_length / cp``;
- tensor parallelism divides what a layer saves except the hidden-size tensors (norm and linear
  inputs: the engine runs without sequence parallelism);
- pipeline parallelism: a stage holds ``layers / pp`` layers, and 1F1B keeps up to ``pp``
  micro-batches in flight on the first stage (the heaviest);
- ``train.offload_layers``: those layers' activations are in host memory at the peak (the end of
  the forward), so they drop out;
- ChunkPipe (``train.seq_chunks=N``): a layer holds one chunk's activations (``seq_length / N``
  tokens) at a time, plus the keys and values every chunk carries (``carried_kv_gib``: each
  layer's K/V of the whole sequence, counted three times: the carried tensors, the
  concatenation the chunk's attention saves, and their accumulated gradients), computed from the
  K/V shapes rather than measured. Under pipeline parallelism the stages run one micro-batch at a
  time (its chunks fill the pipeline), so one micro-batch is in flight, and a stage after the
  first (then the heaviest) also keeps every chunk's input hidden states (``stage_inputs_gib``).

The figure is the tensors autograd holds at the end of a micro-batch's forward; the GPU kernels
can save slightly different tensors than the CPU references the proxy runs.
"""

from __future__ import annotations

import tempfile
import weakref
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

TOKENS = (256, 512, 1024)  # the proxy's token counts (one sequence each)


@dataclass(frozen=True)
class LayerCost:
    """Bytes one layer saves for the backward for ``T`` tokens: ``hidden * T`` for the hidden-size
    tensors (replicated under TP) and ``fixed + per_token * T + per_token_sq * T**2`` for the
    rest (divided by TP)."""

    hidden: float
    fixed: float
    per_token: float
    per_token_sq: float

    def bytes(self, tokens: int, tp: int = 1) -> float:
        return self.hidden * tokens + (self.fixed + self.per_token * tokens + self.per_token_sq * tokens**2) / tp


def _fit(points: dict[int, float]) -> tuple[float, float, float]:
    """``(c, a, b)`` with ``c + a*T + b*T**2`` through the three ``{T: bytes}`` points."""
    ts = sorted(points)
    solution = torch.linalg.solve(torch.tensor([[1.0, t, t * t] for t in ts], dtype=torch.float64),
                                  torch.tensor([float(points[t]) for t in ts], dtype=torch.float64))
    c, a, b = (float(v) for v in solution)
    return c, a, b


@dataclass(frozen=True)
class ActivationProfile:
    dense: LayerCost | None  # a dense layer (None: the model has none)
    moe: LayerCost | None  # an MoE layer (None: the model has none)
    # the embedding, final norm and loss per token (first and last stage); the CPU's reference loss
    # keeps the fp32 logits, the fused GPU kernel (loongforge-kernels) does not
    outside_per_token: float

    def layer(self, moe: bool) -> LayerCost:
        """The cost of an MoE (``moe``) or a dense layer: a kind the model has."""
        cost = self.moe if moe else self.dense
        if cost is None:
            raise ValueError(f"the profiled model has no {'MoE' if moe else 'dense'} layer")
        return cost


def _proxy_overrides(model) -> dict:
    """The model section of the proxy: one layer of each kind, experts cut to the top-k."""
    changes: dict = {"init_from_hf": None}
    experts = getattr(model, "num_experts", 0)
    if experts:
        first_dense = 1 if getattr(model, "first_k_dense", 0) else 0
        changes.update(num_layers=first_dense + 1, first_k_dense=first_dense,
                       num_experts=model.moe_router_topk, moe_router_num_groups=0, moe_router_group_topk=0)
    else:
        changes.update(num_layers=1)
    return changes


def measure(cfg) -> ActivationProfile:
    """The proxy's bytes per token (see the module docstring). ``cfg`` is an ``LLMConfig``."""
    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.core.training.loop import Trainer
    from loongforge.core.training.schema import LogConfig, ParallelConfig
    from loongforge.llm.recipe import LLMTask

    model = replace(cfg.model, **_proxy_overrides(cfg.model))
    longest = max(TOKENS)
    proxy = replace(cfg, model=model, recipe="pretrain", parallel=ParallelConfig(), fp8="none",
                    train=replace(cfg.train, seq_length=longest, global_batch_size=1, micro_batch_size=1,
                                  precision="bf16", offload_layers=0, steps=1),
                    checkpoint=replace(cfg.checkpoint, save=False, load=None, resume=False))
    counts: dict[int, list[dict]] = {}
    ctx = init_parallel(seed=0)
    scratch = tempfile.TemporaryDirectory(prefix="lf-activations-")
    try:
        proxy = replace(proxy, log=LogConfig(progress=False, tensorboard=False, run_dir=scratch.name))
        trainer = Trainer(LLMTask(proxy), ctx, proxy)
        batch = next(trainer.task.steps(ctx, 0)).micro_batches[0]
        for tokens in TOKENS:
            micro = {k: v[:, :tokens] if v.dim() > 1 else v for k, v in batch.items()}
            counts[tokens] = _saved_bytes(trainer.engine, micro, model.hidden_size)
    finally:
        destroy_parallel()
        scratch.cleanup()
    kinds = ["dense"] * (model.num_layers - 1) + ["moe"] if getattr(model, "num_experts", 0) else ["dense"]
    costs = {}
    last = TOKENS[-1]
    for index, kind in enumerate(kinds):
        fixed_h, hidden, _ = _fit({t: counts[t][index]["hidden"] for t in TOKENS})
        fixed, per_token, per_token_sq = _fit({t: counts[t][index]["other"] for t in TOKENS})
        costs[kind] = LayerCost(hidden=hidden, fixed=fixed + fixed_h, per_token=per_token, per_token_sq=per_token_sq)
    outside = counts[last][-1]["outside"] / last
    return ActivationProfile(dense=costs.get("dense"), moe=costs.get("moe"), outside_per_token=outside)


class _Held:
    """A tensor autograd saved, with the layer that saved it (None: outside the layers)."""

    __slots__ = ("tensor", "layer", "__weakref__")

    def __init__(self, tensor: torch.Tensor, layer: int | None):
        self.tensor, self.layer = tensor, layer


def _saved_bytes(engine, micro: dict, hidden: int) -> list[dict]:
    """One forward and backward of the proxy on ``micro``; per layer the bytes its saved tensors hold
    at the end of the model's forward (hidden-size tensors and the rest; each storage once,
    parameters not counted), and in the last entry what was saved outside the layers by then.

    A tensor belongs to the layer whose forward started last, until a module outside every layer
    starts (the final norm, the output layer): so under full recomputation the layer input that
    megatron's checkpoint saves after running the layer counts for that layer."""
    from loongforge.core.training.megatron_engine import transformer_layers
    from loongforge.core.training.task import StepBatch

    model = engine.inner_model
    layers = transformer_layers(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = {id(m) for layer in layers for m in layer.modules()}
    holds_layer = {id(m) for m in model.modules() if any(id(c) in {id(x) for x in layers} for c in m.modules())}
    held: weakref.WeakSet = weakref.WeakSet()
    current: list[int | None] = [None]
    snapshot: list[dict] = []

    def pack(t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in params:
            return t
        h = _Held(t, current[0])
        held.add(h)
        return h

    def unpack(h):
        return h.tensor if isinstance(h, _Held) else h

    def count(*_):
        rows = [defaultdict(int) for _ in layers]
        outside, seen = 0, set()
        for h in list(held):
            t = h.tensor
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
            if key in seen:
                continue
            seen.add(key)
            size = t.numel() * t.element_size()
            if h.layer is None:
                outside += size
            else:
                rows[h.layer]["hidden" if t.shape and t.shape[-1] == hidden else "other"] += size
        snapshot[:] = [{"hidden": r["hidden"], "other": r["other"], "outside": 0} for r in rows]
        snapshot[-1]["outside"] = outside

    handles = [model.register_forward_hook(count)]
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=index: current.__setitem__(0, i)))
    for module in model.modules():
        if id(module) not in inside and id(module) not in holds_layer:
            handles.append(module.register_forward_pre_hook(lambda m, a: current.__setitem__(0, None)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            engine.forward_backward(StepBatch(micro_batches=[micro]))  # no update: no optimizer state is made
    finally:
        for handle in handles:
            handle.remove()
    return snapshot


def per_gpu(profile: ActivationProfile, cfg, layout, micro_batch_size: int, num_microbatches: int) -> dict:
    """Activation bytes of the heaviest GPU (the first pipeline stage; under ChunkPipe a later one,
    which also holds ``stage_inputs_gib``) for ``cfg``'s sequence length and offloading,
    ``micro_batch_size`` sequences per micro-batch and ``num_microbatches`` per step, under ``layout``."""
    model, train = cfg.model, cfg.train
    chunks = getattr(train, "seq_chunks", 1)
    tokens = micro_batch_size * train.seq_length // layout.cp // chunks
    pattern = getattr(model, "moe_layer_pattern", None) or [0] * model.num_layers
    per_stage = model.num_layers // layout.pp
    stage_layers = pattern[:per_stage]  # the first stage: the heaviest in flight
    resident = stage_layers[train.offload_layers:]
    layer_bytes = [profile.layer(kind).bytes(tokens, layout.tp) for kind in resident]
    in_flight = 1 if chunks > 1 else min(layout.pp, num_microbatches)  # ChunkPipe: one micro-batch at a time
    outside = profile.outside_per_token * tokens * in_flight
    layers = sum(layer_bytes) * in_flight
    offloaded = sum(profile.layer(kind).bytes(tokens, layout.tp)
                    for kind in stage_layers[:train.offload_layers]) * in_flight
    gib = 1024**3
    extra = {}
    if chunks > 1:  # K/V of the whole sequence per layer, bf16, split over TP with the heads
        kv_heads = getattr(model, "num_query_groups", model.num_attention_heads)
        carried = 3 * 2 * kv_heads * model.head_dim * 2 * tokens * chunks * per_stage / layout.tp
        extra = {"seq_chunks": chunks, "carried_kv_gib": round(carried / gib, 3)}
        if layout.pp > 1:  # a later stage's inputs: the bf16 hidden states of every chunk (replicated over TP)
            extra["stage_inputs_gib"] = round(2 * model.hidden_size * tokens * chunks / gib, 3)
    return {"tokens_per_microbatch": tokens * chunks, **({"tokens_per_chunk": tokens} if chunks > 1 else {}),
            **extra, "layers_on_stage": per_stage, "microbatches_in_flight": in_flight,
            "offloaded_layers": min(train.offload_layers, per_stage),
            "per_layer_gib": round(max(layer_bytes, default=0.0) / gib, 3),
            "layers_gib": round(layers / gib, 3), "embedding_and_loss_gib": round(outside / gib, 3),
            "offloaded_to_host_gib": round(offloaded / gib, 3),
            "note": "tensors saved for the backward at the end of the forward, measured on a CPU proxy "
                    "(lf-llm's activation_memory); the CPU loss keeps fp32 logits, the fused GPU kernel does not"}
