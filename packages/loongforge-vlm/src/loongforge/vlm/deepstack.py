"""DeepStack (Qwen3-VL): vision features of intermediate encoder layers, each merged by a patch
merger of its own (``patch_merge_mlp`` with the norm over the merged patches), are added to the
hidden states of the foundation's first layers at the vision tokens: feature ``k`` to the output
of decoder layer ``k``.

The foundation is megatron's ``GPTModel``, whose block runs its layers in one loop with a fixed
set of arguments, so the additions enter through forward hooks on the first layers, registered
for the one forward call that needs them (``added_to_layer_outputs``). Each addition is a dense
``[s, b, h]`` tensor (zero off the vision tokens), sliced like the hidden states under sequence
parallelism. The hooks are gone when the backward pass runs, so full-layer activation recompute
(which re-runs the layers there) cannot be combined with DeepStack; the model refuses it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from loongforge.vlm.model_config import EncoderConfig, ProjectorConfig
from loongforge.vlm.projectors.patch_merge_mlp import PatchMergeMLPConfig


def merger_config(projector: ProjectorConfig) -> PatchMergeMLPConfig:
    """The config of a DeepStack merger: the projector's norm type and epsilon, over the merged patches."""
    return PatchMergeMLPConfig(norm=getattr(projector, "norm", "layernorm"), merged_norm=True,
                               norm_epsilon=projector.norm_epsilon)


def build_mergers(encoder: EncoderConfig, projector: ProjectorConfig, foundation_hidden: int, foundation_config,
                  pg_collection) -> torch.nn.ModuleList:
    """One merger per DeepStack layer of the encoder."""
    from loongforge.vlm.projectors import build_projector

    cfg = merger_config(projector)
    return torch.nn.ModuleList([build_projector(cfg, encoder, foundation_hidden, foundation_config, pg_collection)
                                for _ in encoder.deepstack_indices()])


def dense_additions(features: list[torch.Tensor], placeholders: torch.Tensor, dtype) -> list[torch.Tensor]:
    """Each ``[vision tokens, h]`` feature as an ``[s, b, h]`` tensor holding its rows at the
    ``placeholders [b, s]`` (row-major order) and zeros elsewhere."""
    b, s = placeholders.shape
    out = []
    for feature in features:
        dense = feature.new_zeros((b, s, feature.shape[-1]), dtype=dtype)
        out.append(dense.masked_scatter(placeholders[..., None], feature.to(dtype)).transpose(0, 1).contiguous())
    return out


@contextmanager
def added_to_layer_outputs(layers, additions: list[torch.Tensor]):
    """While open, the output hidden states of ``layers[k]`` get ``additions[k]`` added."""

    def hook(addition):
        def add(module, args, output):
            hidden, *rest = output
            return (hidden + addition, *rest)
        return add

    handles = [layer.register_forward_hook(hook(addition)) for layer, addition in zip(layers, additions)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
