"""megatron-core layer modules of LoongForge's Transformer-Engine-free fast path.

``attention.SDPAttention`` is a core-attention submodule on ``torch.nn.functional.scaled_dot_product_attention``
(dense causal batches and packed THD sequences); ``spec.fast_layer_spec`` assembles a decoder layer
from it and from the fused ops of ``loongforge.core.kernels`` (``norm``, ``self_attention``, ``mlp``,
``transformer_layer``); ``gpt_model.FusedLossGPTModel`` computes the LM loss without full logits.
"""
