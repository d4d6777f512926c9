"""megatron's ``GPTModel`` whose training loss never materialises the ``[tokens, vocab]`` logits.

With ``labels``, ``GPTModel`` computes the full logits (plus an fp32 copy inside the
cross-entropy) and then the per-token loss. ``FusedLossGPTModel`` hands megatron's
``output_processor`` hook the registry's ``linear_cross_entropy``: the output projection and the
loss in token chunks (Triton where supported; the torch reference elsewhere), returning the same
``[b, s]`` fp32 per-token loss (zero where ``loss_mask``, when the caller passes it, is zero: those
tokens take ``IGNORE_INDEX``, so every counted token's loss gets the same gradient factor and the op
makes its gradients in the forward; with the mask passed, the model promises the op that factor
(``uniform_grad``: its backward reads nothing back), which holds for a loss summed or averaged over
the 0/1 mask, as ``masked_token_loss``; a loss weighting the tokens otherwise must not pass the
mask, or its step turns non-finite). Without labels, with a vocab split over tensor-parallel ranks,
multi-token prediction or MuP logit scaling, megatron's own path runs.

Under context parallelism with the fast layer (``FusedSelfAttention``) the rotary embedding hands
the layers the angles of the whole sequence, not this CP rank's slice of them: the layers rotate
each local token by its global position, which also covers packed (THD) rows, and megatron's own
per-rank slice (``get_pos_emb_on_this_cp_rank``) builds its index in pinned CUDA memory.

Its ``FusedSelfAttention`` layers share the model's RoPE cos/sin tables (``share_rope_tables``),
and its word embedding adds its gradient rows straight into megatron DDP's buffer where its table is
its own on one tensor-parallel rank (``main_grad_embedding``).
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel

from loongforge.core.kernels import KernelPolicy


IGNORE_INDEX = -100  # the label of a token the loss mask leaves out


class FusedLossGPTModel(GPTModel):
    """``kernels``: the policy its ``linear_cross_entropy`` is resolved by."""

    def __init__(self, *args, kernels: KernelPolicy = KernelPolicy(), **kwargs):
        from loongforge.llm.layers.main_grad_embedding import use_main_grad_embedding
        from loongforge.llm.layers.self_attention import share_rope_tables

        super().__init__(*args, **kwargs)
        self._linear_cross_entropy = kernels.get("linear_cross_entropy")
        share_rope_tables(self)
        use_main_grad_embedding(self, kernels)
        if self.config.context_parallel_size > 1 and self._fast_attention():
            self.rotary_pos_emb.cp_group = None  # the whole sequence's angles (see the module docstring)

    def _fast_attention(self) -> bool:
        """Whether this stage's attention layers attend through ``FusedSelfAttention`` (its RoPE takes
        global positions); token mixers that are no megatron ``Attention`` (Qwen3.5's Gated DeltaNet)
        take no RoPE and do not count."""
        from megatron.core.transformer.attention import Attention

        from loongforge.llm.layers.self_attention import FusedSelfAttention

        layers = getattr(getattr(self, "decoder", None), "layers", [])
        mixers = [getattr(layer, "self_attention", None) for layer in layers]
        fused = [isinstance(mixer, FusedSelfAttention) for mixer in mixers if isinstance(mixer, Attention)]
        if any(fused) and not all(fused):
            raise ValueError("FusedLossGPTModel: context parallelism needs every layer on FusedSelfAttention or none")
        return hasattr(self, "rotary_pos_emb") and all(fused) and bool(fused)

    def _fused_loss_applies(self) -> bool:
        cfg = self.config
        return (
            self.post_process
            and self.pg_collection.tp.size() == 1
            and not cfg.mtp_num_layers
            and not cfg.use_mup
        )

    def _loss(self, *, hidden_states, output_layer, output_weight, labels, loss_mask=None, **_):
        weight = output_weight if output_weight is not None else output_layer.weight
        s, b, h = hidden_states.shape
        if loss_mask is not None:  # uncounted tokens are ignored: the op's gradients then need one factor
            labels = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
        # a task that passes its 0/1 loss mask sums the per-token losses over it (masked_token_loss): each
        # counted token's loss gets the same gradient, and the op's backward reads nothing back
        loss = self._linear_cross_entropy(hidden_states.reshape(s * b, h), weight,
                                          labels.transpose(0, 1).reshape(s * b), IGNORE_INDEX,
                                          uniform_grad=loss_mask is not None)
        return loss.view(s, b).transpose(0, 1).contiguous()  # [b, s], as compute_language_model_loss

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, *args, **kwargs):
        if labels is not None and kwargs.get("output_processor") is None and self._fused_loss_applies():
            kwargs["output_processor"] = self._loss
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels, *args, **kwargs)
