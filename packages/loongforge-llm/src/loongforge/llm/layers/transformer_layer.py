"""A megatron ``TransformerLayer`` whose forward fuses the residual add into the pre-MLP norm,
drops the no-op bias/dropout/add machinery, and keeps only the activations the backward needs.

Pre-norm decoder layer::

    normed, x = input_layernorm.with_residual(x)      # x's two gradients summed in the norm's backward
    a = self_attention(normed)
    normed2, s = pre_mlp_layernorm(a, residual=x)     # fused: rms_norm(a + x), a + x
    out = mlp(normed2) + s

With ``recompute_elementwise`` (default) the two norm outputs and the SwiGLU output are freed
after the matmul that consumes them and recomputed in the backward from tensors that are kept
anyway (the layer input, the residual sum, ``linear_fc1``'s output): about 40% of a layer's
activations for a few elementwise passes. The norms run with their own graphs (the residual add
fused into the pre-MLP norm both ways, as without recomputation: ``DiscardedOutput.hand_over``);
only their outputs are made again, for the linears' weight gradients. Under full-layer recompute there is nothing to gain,
so it is off. Inference, hidden dropout, fp32 residuals and cross attention take megatron's own
forward. Parameter names and the sharded state dict are the parent's (the same checkpoints).
"""

from __future__ import annotations


from megatron.core.transformer.transformer_layer import TransformerLayer

from loongforge.llm.layers.discarded_output import DiscardedOutput
from loongforge.llm.layers.mlp import FusedMLP
from loongforge.llm.layers.norm import FusedRMSNorm


class FusedTransformerLayer(TransformerLayer):
    def __init__(self, *args, recompute_elementwise: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.recompute_elementwise = recompute_elementwise and self.config.recompute_granularity != "full"
        if isinstance(self.mlp, FusedMLP):
            self.mlp.recompute_activation = self.recompute_elementwise
        # the input norm passes the residual stream on itself where it can (its two gradients summed in its backward)
        self._norm_passes_stream = isinstance(self.input_layernorm, FusedRMSNorm)

    def _own_path(self, kwargs) -> bool:
        return (
            kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
            and kwargs.get("context") is None
            and not (self.training and self.hidden_dropout > 0)
            and not self.config.fp32_residual_connection
            and not self.is_moe_layer
        )

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if not self._own_path(kwargs):
            return super().forward(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        recompute = self.recompute_elementwise and self.training and hidden_states.requires_grad
        attn_kwargs = {k: kwargs.get(k) for k in ("rotary_pos_emb", "attention_bias", "packed_seq_params")}

        if self._norm_passes_stream:
            normed, stream = self.input_layernorm.with_residual(hidden_states)
        else:
            normed, stream = self.input_layernorm(hidden_states), hidden_states
        if recompute:
            norm1 = DiscardedOutput()
            norm1.hand_over(normed, self.input_layernorm, hidden_states,
                            consumer=getattr(self.self_attention, "linear_qkv", None))
        attn, attn_bias = self.self_attention(normed, attention_mask=attention_mask, **attn_kwargs)
        if recompute:
            norm1.discard(attn)
        if attn_bias is not None:
            attn = attn + attn_bias

        normed2, residual = self.pre_mlp_layernorm(attn, residual=stream)
        if recompute:
            norm2 = DiscardedOutput()
            norm2.hand_over(normed2, self.pre_mlp_layernorm, residual, consumer=self.mlp.linear_fc1)
        out, out_bias = self.mlp(normed2)
        if recompute:
            norm2.discard(out)
        if out_bias is not None:
            out = out + out_bias
        return out + residual, kwargs.get("context")
