"""Pi0.5's backbone with a DiT flow-matching action head (a GR00T-style design, not GR00T: no
GR00T checkpoint loads into it; ``groot_n1_7`` is GR00T N1.7's action head).

The backbone (SigLIP + Gemma layers, the same ``PrefixEmbedder``/``JointLayer`` as Pi0.5 but
without an expert stream) encodes cameras and instruction once; the hidden states of layer
``model.dit.vlm_layer`` are layer-normed and projected into the head. The head embeds the
state (one token) and the noisy action chunk (actions + sinusoidal time, GR00T's action
encoder), adds learned positions, and runs DiT blocks: adaLN-zero conditioning on the time
embedding, self-attention over state + action tokens, cross-attention to the backbone
features. The velocity comes from a final adaLN + linear layer on the action tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loongforge.core.models import ModelSpec
from loongforge.core.training.torch_model import TorchModel
from loongforge.embodied.config import PolicyConfig
from loongforge.embodied.policies.backbone import PrefixEmbedder
from loongforge.embodied.policies.dit import DiTBlock, DiTConfig, modulate, zero_init_adaln
from loongforge.embodied.policies.flow_matching import euler_integrate, interpolate, sinusoidal_embedding, velocity_target
from loongforge.embodied.task import PolicyTask
from loongforge.embodied.policies.layers import (
    JointLayer,
    additive_mask,
    init_linear_weights,
    make_att_2d_masks,
    rope_cos_sin,
)


@dataclass
class Pi05DiTHeadConfig(PolicyConfig):
    """The shared policy fields plus the DiT action head."""

    family: str = "pi05_dit_head"
    discrete_state: bool = False  # the state enters through the head's state encoder
    dit: DiTConfig = field(default_factory=DiTConfig)

    def __post_init__(self):
        super().__post_init__()
        if not -self.vlm.depth <= self.dit.vlm_layer < self.vlm.depth:
            raise ValueError(f"model.dit.vlm_layer={self.dit.vlm_layer}: out of range for model.vlm.depth={self.vlm.depth}")


class Pi05DiTHeadPolicy(TorchModel):
    family = "pi05_dit_head"
    recompute_modes = ("full",)  # train.recompute=full: each repeated block recomputed in the backward
    fsdp_forward_methods = ("sample_actions",)

    def __init__(self, cfg: Pi05DiTHeadConfig):
        super().__init__()
        self.cfg = cfg
        vlm, dit = cfg.vlm, cfg.dit
        self.num_vlm_layers = dit.vlm_layer % vlm.depth + 1
        self.prefix = PrefixEmbedder(cfg)
        self.layers = nn.ModuleList([JointLayer(vlm) for _ in range(self.num_vlm_layers)])
        w = dit.width
        self.vl_norm = nn.LayerNorm(vlm.width)
        self.vl_proj = nn.Linear(vlm.width, w)
        self.state_encoder = nn.Sequential(nn.Linear(cfg.max_state_dim, w), nn.SiLU(), nn.Linear(w, w))
        self.action_in = nn.Linear(cfg.max_action_dim, w)
        self.action_time_mix = nn.Linear(2 * w, w)
        self.action_time_out = nn.Linear(w, w)
        self.position = nn.Embedding(cfg.chunk_size + 1, w)
        self.time_embed = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.blocks_ = nn.ModuleList([DiTBlock(dit) for _ in range(dit.depth)])
        self.norm_out = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(w, 2 * w)
        self.action_out = nn.Linear(w, cfg.max_action_dim)
        init_linear_weights(self, skip=(self.prefix.vision_tower,))
        for block in self.blocks_:
            zero_init_adaln(block)
        nn.init.zeros_(self.ada_out.weight)
        nn.init.zeros_(self.ada_out.bias)
        self.activation_checkpointing = False

    def repeated_blocks(self) -> list[nn.Module]:
        """The repeated blocks: FSDP units, activation-checkpoint and compile targets."""
        return self.prefix.vision_layers() + list(self.layers) + list(self.blocks_)

    def set_recompute(self, mode: str) -> None:
        self.activation_checkpointing = mode == "full"

    def _block(self, block, *args):
        if self.activation_checkpointing and self.training:
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Backbone features projected to the head width ``[B, T, W]`` and their validity ``[B, T]``."""
        h, pad = self.prefix(batch["images"], batch["image_mask"], batch["tokens"], batch["token_mask"])
        mask = additive_mask(make_att_2d_masks(pad, torch.zeros_like(pad)))
        cos, sin = rope_cos_sin(torch.cumsum(pad.long(), 1) - 1, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, h.dtype)
        for layer in self.layers:
            h, _, _ = self._block(layer, h, None, cos, sin, mask)
        return self.vl_proj(self.vl_norm(h)), pad

    def head(self, feats, feats_pad, state, x_t, t) -> torch.Tensor:
        cfg, w = self.cfg, self.cfg.dit.width
        dtype = self.action_in.weight.dtype
        temb_sin = sinusoidal_embedding(t, w, cfg.min_period, cfg.max_period).to(dtype)
        temb = self.time_embed(temb_sin)
        a = self.action_in(x_t.to(dtype))
        a = self.action_time_out(F.silu(self.action_time_mix(torch.cat([a, temb_sin[:, None].expand_as(a)], -1))))
        s = self.state_encoder(state.to(dtype))[:, None]
        x = torch.cat([s, a], 1) + self.position.weight[None]
        ctx_mask = additive_mask(feats_pad[:, None, :].expand(-1, x.shape[1], -1))
        for block in self.blocks_:
            x = self._block(block, x, temb, feats, ctx_mask)
        shift, scale = self.ada_out(F.silu(temb)).chunk(2, dim=-1)
        return self.action_out(modulate(self.norm_out(x), shift, scale)[:, 1:]).float()

    def forward(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        actions = batch["actions"].float()
        feats, pad = self.features(batch)
        v = self.head(feats, pad, batch["state"], interpolate(actions, noise, t), t)
        return (velocity_target(actions, noise) - v) ** 2

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, num_steps: int | None = None) -> torch.Tensor:
        feats, pad = self.features(batch)
        return euler_integrate(
            lambda x_t, t: self.head(feats, pad, batch["state"], x_t, t),
            noise.float(),
            num_steps or self.cfg.num_inference_steps,
        )


PI05_DIT_HEAD_SPEC = ModelSpec(name="pi05_dit_head", config_class=Pi05DiTHeadConfig, build=Pi05DiTHeadPolicy, engine="torch",
                               task=PolicyTask)
