"""megatron's vocabulary embedding whose backward adds the looked-up rows' gradients straight into
megatron DDP's gradient buffer (``weight.main_grad``).

Autograd's embedding backward makes a dense ``[vocab, hidden]`` gradient (a zero fill of the whole
table, then the rows) that megatron DDP's hook adds into ``main_grad``: at a 128k vocabulary and
hidden 2048, three passes over a 0.5 GB table a step for the ~8k rows a batch touches. Here the
backward adds only those rows into ``main_grad`` (the registry's ``embedding_grad_add``: the rows
of repeated tokens summed in fp32 in a fixed order, deterministic) and hands autograd a
placeholder with ``weight.grad_added_to_main_grad`` set, megatron's convention, as
``MainGradLinear`` does.

It applies inside the megatron engine's schedule (``main_grad_fusion_active``) to a table of its
own: on one tensor-parallel rank (no vocabulary split, no sequence-parallel scatter), not shared
with the output layer or a multi-token-prediction head (a shared weight also takes a real gradient
from autograd, which the placeholder convention would drop). ``use_main_grad_embedding(model)``
makes a ``GPTModel``'s embedding one where that holds (its class specialised in place, the
parameter and its state-dict names unchanged).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding

from loongforge.core.kernels import KernelPolicy
from loongforge.core.training.main_grad import main_grad_fusion_active


class MainGradEmbeddingLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)``; the rows' gradients go into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, ids, weight, grad_add):
        ctx.save_for_backward(ids)
        ctx.weight = weight  # the parameter itself (its main_grad), as MainGradLinear keeps it
        ctx.grad_add = grad_add  # the registry's embedding_grad_add
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        ctx.grad_add(weight.main_grad, ids, dy)
        weight.grad_added_to_main_grad = True
        return None, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device), None


class MainGradVocabParallelEmbedding(VocabParallelEmbedding):
    """``VocabParallelEmbedding`` whose lookup adds its gradient into ``main_grad`` (see the module
    docstring); megatron's own forward where the schedule does not read ``main_grad``.
    ``grad_add``: the registry's ``embedding_grad_add`` (set by ``use_main_grad_embedding``)."""

    grad_add: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

    def forward(self, input_):
        weight = self.weight
        if main_grad_fusion_active() and weight.requires_grad and hasattr(weight, "main_grad"):
            return MainGradEmbeddingLookup.apply(input_, weight, self.grad_add)
        return super().forward(input_)


def use_main_grad_embedding(model, kernels: KernelPolicy) -> bool:
    """Make ``model``'s (a megatron ``GPTModel``) word embedding a ``MainGradVocabParallelEmbedding``
    (its ``embedding_grad_add`` resolved by ``kernels``) where its table is its own on one
    tensor-parallel rank; returns whether it did."""
    embedding = getattr(model, "embedding", None) if getattr(model, "pre_process", False) else None
    table = getattr(embedding, "word_embeddings", None)
    if table is None or type(table) is not VocabParallelEmbedding:
        return False
    if (table.tp_group.size() != 1 or table.reduce_scatter_embeddings or table.gtp_remat_size != 1
            or model.share_embeddings_and_output_weights or model.config.mtp_num_layers):
        return False
    table.__class__ = MainGradVocabParallelEmbedding  # a subclass whose one attribute is set next
    table.grad_add = kernels.get("embedding_grad_add")
    return True
