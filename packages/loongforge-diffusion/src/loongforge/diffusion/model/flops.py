"""Training FLOPs of the Wan DiT (matmuls, 2 FLOPs per multiply-add, backward = 2x forward):
the balancer's cost model and MFU."""

from __future__ import annotations

from loongforge.core.balance import CostModel
from loongforge.diffusion.model.config import WanConfig

IMAGE_TOKENS = 257  # CLIP ViT-H/14 tokens of a 224x224 image (Wan 2.1 I2V's image encoder)


def cost_model(cfg: WanConfig) -> CostModel:
    """Cost of one sample of ``l`` tokens: ``a * l**2 + b * l + c`` FLOPs.

    Per layer and token: self-attention q/k/v/o ``4 D^2``, cross-attention q/o ``2 D^2`` and scores
    over the prompt ``2 D L``, feed-forward ``2 D F``; per segment: self-attention scores and
    weighted sum ``2 D l^2``; per sample: cross-attention k/v of the prompt ``2 D^2 L``; once per
    token: patch embedding and output projection ``2 D C p``. Wan 2.1 I2V's image tokens count as
    prompt tokens (their keys/values and scores; ``IMAGE_TOKENS``, CLIP ViT-H's 257).
    """
    d, n, f = cfg.hidden_size, cfg.num_layers, cfg.ffn_dim
    L = cfg.text_len + (IMAGE_TOKENS if cfg.image_dim else 0)  # I2V: a second attention over image tokens
    p = cfg.patch_volume
    k = 3 * 2  # (forward + backward) * FLOPs per multiply-add
    a = k * n * 2 * d
    b = k * (n * (6 * d * d + 2 * d * L + 2 * d * f) + d * p * (cfg.in_channels + cfg.out_channels))
    c = k * n * 2 * d * d * L
    return CostModel(a=float(a), b=float(b), c=float(c))
