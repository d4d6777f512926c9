"""InternViT's query/key norm: an RMSNorm over all heads of a token together (the whole
projection width, not each head as megatron's ``qk_layernorm`` norms do), with its own epsilon.

Megatron applies ``q_layernorm``/``k_layernorm`` to ``[s, b, heads, head_dim]``; this module
flattens the heads, norms, and restores the shape. It needs every head on the rank, so it
refuses a tensor-parallel encoder."""

from __future__ import annotations

import torch

QK_NORM_EPS = 1e-6  # transformers' InternVLVisionRMSNorm default, which its attention uses


class WholeWidthRMSNorm(torch.nn.Module):
    """RMSNorm over ``heads * head_dim`` (``config.num_attention_heads * config.kv_channels``)."""

    def __init__(self, hidden_size: int, config, eps: float = QK_NORM_EPS, **unused):
        super().__init__()
        if config.tensor_model_parallel_size != 1:
            raise ValueError("encoder.qk_norm norms over all heads together: it needs parallel.encoder.tp=1")
        self.eps = QK_NORM_EPS  # megatron passes the per-head width and the layers' epsilon: both unused
        self.weight = torch.nn.Parameter(torch.ones(config.num_attention_heads * config.kv_channels,
                                                    dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(*shape[:-2], -1).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype)).reshape(shape)
