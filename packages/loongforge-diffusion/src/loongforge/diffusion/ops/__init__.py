"""The ops loongforge-diffusion defines for the kernel registry (``loongforge.ops`` entry points in
its ``pyproject.toml``): Wan self-attention's query/key RMSNorm + RoPE, ``qk_norm_rope`` and its
backward (``qk_norm_rope``: the torch references, the contracts loongforge-kernels' fused versions
match), and the autograd function that calls them (``attention_inputs.normed_rotated_qkv``).
Importing this package imports neither diffusers nor the Wan model."""
