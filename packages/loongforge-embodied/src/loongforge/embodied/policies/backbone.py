"""The PaliGemma-style prefix: SigLIP vision tower (transformers ``SiglipVisionModel``) with a
linear projector into the language width, plus scaled token embeddings (Gemma's sqrt(width))."""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from loongforge.embodied.config import PolicyConfig
from loongforge.embodied.policies.layers import embed_scale


def siglip_config(cfg: PolicyConfig) -> SiglipVisionConfig:
    v = cfg.vision
    return SiglipVisionConfig(
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_layers,
        num_attention_heads=v.num_heads,
        image_size=cfg.image_size,
        patch_size=v.patch_size,
        layer_norm_eps=v.layer_norm_eps,
        hidden_act="gelu_pytorch_tanh",
        vision_use_head=False,
        attn_implementation="sdpa",
    )


class PrefixEmbedder(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.vision_tower = SiglipVisionModel(siglip_config(cfg))
        self.multi_modal_projector = nn.Linear(cfg.vision.hidden_size, cfg.vlm.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.vlm.width)
        self.scale = embed_scale(cfg.vlm.width)

    def vision_layers(self) -> list[nn.Module]:
        return list(self.vision_tower.encoder.layers)

    def forward(self, images: torch.Tensor, image_mask: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor):
        """``images [B, N, 3, S, S]`` -> prefix embeddings ``[B, N*P + L, W]`` and validity ``[B, N*P + L]``."""
        b, n = images.shape[:2]
        pixel = images.flatten(0, 1).to(self.vision_tower.dtype)
        feats = self.multi_modal_projector(self.vision_tower(pixel_values=pixel).last_hidden_state)
        p = feats.shape[1]
        img_emb = feats.reshape(b, n * p, -1)
        img_pad = image_mask[:, :, None].expand(b, n, p).reshape(b, n * p)
        emb_weight = self.embed_tokens.weight
        lang = self.embed_tokens(tokens) * torch.tensor(self.scale, dtype=emb_weight.dtype)
        return torch.cat([img_emb, lang.to(img_emb.dtype)], 1), torch.cat([img_pad, token_mask.bool()], 1)
