"""The ops loongforge-llm defines for the kernel registry (``loongforge.ops`` entry points in its
``pyproject.toml``): DeepSeek sparse attention's ``dsa_indexer_topk``, ``dsa_indexer_loss`` and
``sparse_mla_attention`` (``dsa``), the blockwise FP8 ``fp8_linear`` (``fp8_blockwise``) and
``grouped_qkv_rope`` (``grouped_qkv_rope``: megatron's QKV projection output split and rotated). Each
module holds the ops' torch references, the contracts loongforge-kernels' fused versions match."""
