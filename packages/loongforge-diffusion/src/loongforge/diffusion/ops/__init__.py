"""The ops loongforge-diffusion defines for the kernel registry (``loongforge.ops`` entry points in
its ``pyproject.toml``) and the autograd functions of its DiTs that call them:

- ``qk_norm_rope``: Wan self-attention's query/key RMSNorm + RoPE and its backward (the torch
  references, the contracts loongforge-kernels' fused versions match), called by
  ``attention_inputs.normed_rotated_qkv``;
- ``layer_norm``: the adaLN LayerNorm ``modulated_layer_norm`` and its backward, called by
  ``modulated_norm.normalize_and_modulate``;
- ``gelu``: the tanh-GELU backward and the GELU output cast to FP8, called by
  ``feed_forward.gelu_feed_forward`` (the DiT feed-forward with its own backward);
- ``fp8_tensorwise``: the tensor-wise FP8 linear and its ``fp8_cast_transpose`` op.

Importing this package imports neither diffusers nor a DiT model."""
