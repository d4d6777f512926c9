"""megatron's vocabulary embedding whose backward adds the looked-up rows' gradients straight into
megatron DDP's gradient buffer (``weight.main_grad``).

Autograd's embedding backward makes a dense ``[vocab, hidden]`` gradient (a zero fill of the whole
table, then the rows) that megatron DDP's hook adds into ``main_grad``: at a 128k vocabulary and
hidden 2048, three passes over a 0.5 GB table a step for the ~8k rows a batch touches. Here the
backward adds only those rows into ``main_grad`` (``index_put_`` with accumulation: the rows of
repeated tokens summed in fp32 in a fixed order, deterministic) and hands autograd a placeholder
with ``weight.grad_added_to_main_grad`` set, megatron's convention, as ``MainGradLinear`` does.

It applies inside the megatron engine's schedule (``main_grad_fusion_active``) to a table of its
own: on one tensor-parallel rank (no vocabulary split, no sequence-parallel scatter), not shared
with the output layer or a multi-token-prediction head (a shared weight also takes a real gradient
from autograd, which the placeholder convention would drop). ``use_main_grad_embedding(model)``
makes a ``GPTModel``'s embedding one where that holds (its class specialised in place, the
parameter and its state-dict names unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding

from loongforge.core.training.main_grad import main_grad_fusion_active


class MainGradEmbeddingLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)``; the rows' gradients go into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the parameter itself (its main_grad), as MainGradLinear keeps it
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows = dy.reshape(-1, dy.shape[-1]).to(weight.main_grad.dtype)
        weight.main_grad.index_put_((ids.reshape(-1),), rows, accumulate=True)
        weight.grad_added_to_main_grad = True
        return None, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


class MainGradVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` whose lookup adds its gradient into ``main_grad`` (see the module
    docstring); megatron's own forward where the schedule does not read ``main_grad``."""

    def forward(self, input_):
        weight = self.weight
        if main_grad_fusion_active() and weight.requires_grad and hasattr(weight, "main_grad"):
            return MainGradEmbeddingLookup.apply(input_, weight)
        return super().forward(input_)


def use_main_grad_embedding(model) -> bool:
    """Make ``model``'s (a megatron ``GPTModel``) word embedding a ``MainGradVocabParallelEmbedding``
    where its table is its own on one tensor-parallel rank; returns whether it did."""
    embedding = getattr(model, "embedding", None) if getattr(model, "pre_process", False) else None
    table = getattr(embedding, "word_embeddings", None)
    if type(table) is not VocabParallelEmbedding:
        return False
    if (table.tp_group.size() != 1 or table.reduce_scatter_embeddings or table.gtp_remat_size != 1
            or model.share_embeddings_and_output_weights or model.config.mtp_num_layers):
        return False
    table.__class__ = MainGradVocabParallelEmbedding  # a subclass with no state of its own
    return True
