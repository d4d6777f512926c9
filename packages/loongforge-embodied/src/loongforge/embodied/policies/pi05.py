"""Pi0.5-style VLA policy.

A PaliGemma-style backbone (SigLIP + Gemma) reads the cameras and the prompt (instruction and,
with ``discrete_state``, the 256-bin state tokens); a smaller Gemma-style action expert reads
the noisy action chunk. Layer ``i`` of both attend jointly (``JointLayer``): the prefix attends
bidirectionally within itself, the action tokens attend to the whole prefix and to each other.
The flow-matching time enters the expert through adaptive RMSNorm (Pi0.5's adaRMS); the
expert's output is projected to the action velocity. Inference runs the prefix once, caches
its keys/values per layer and integrates the velocity with Euler steps.

Parameter names follow LeRobot's ``PI05Pytorch`` closely enough that ``convert.lerobot_pi05``
is a table of renames of the core mapping engine; it is the family's ``hf_adapter``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loongforge.core.models import ModelSpec
from loongforge.embodied.config import GemmaConfig, PolicyConfig
from loongforge.embodied.convert.lerobot_pi05 import LEROBOT_PI05_ADAPTER
from loongforge.embodied.policies.backbone import PrefixEmbedder
from loongforge.embodied.policies.flow_matching import euler_integrate, interpolate, sinusoidal_embedding, velocity_target
from loongforge.embodied.task import PolicyTask
from loongforge.embodied.policies.layers import (
    AdaRMSNorm,
    JointLayer,
    RMSNorm,
    additive_mask,
    init_linear_weights,
    make_att_2d_masks,
    rope_cos_sin,
)


@dataclass
class Pi05Config(PolicyConfig):
    """Pi0.5: the shared policy fields plus the Gemma action expert, which attends jointly with the
    backbone layer by layer (so both stacks agree on heads, head size and depth)."""

    family: str = "pi05"
    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=32, mlp_dim=64))

    def __post_init__(self):
        super().__post_init__()
        v, e = self.vlm, self.expert
        if (v.num_heads, v.num_kv_heads, v.head_dim, v.depth) != (e.num_heads, e.num_kv_heads, e.head_dim, e.depth):
            raise ValueError(
                "policy.vlm and policy.expert must agree on num_heads, num_kv_heads, head_dim and depth "
                f"(the action expert attends jointly with the backbone): vlm={v}, expert={e}"
            )


class Pi05Policy(nn.Module):
    family = "pi05"
    recompute_modes = ("full",)  # train.recompute=full: each repeated block recomputed in the backward
    fsdp_forward_methods = ("sample_actions",)

    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.cfg = cfg
        vlm, expert = cfg.vlm, cfg.expert
        self.prefix = PrefixEmbedder(cfg)
        self.layers = nn.ModuleList([JointLayer(vlm, expert, expert_cond_dim=expert.width) for _ in range(vlm.depth)])
        self.norm = RMSNorm(vlm.width, vlm.rms_norm_eps)
        self.expert_norm = AdaRMSNorm(expert.width, expert.width, expert.rms_norm_eps)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, expert.width)
        self.action_out_proj = nn.Linear(expert.width, cfg.max_action_dim)
        self.time_mlp_in = nn.Linear(expert.width, expert.width)
        self.time_mlp_out = nn.Linear(expert.width, expert.width)
        init_linear_weights(self, skip=(self.prefix.vision_tower,))
        self.activation_checkpointing = False
        for p in self.unreachable_parameters():
            p.requires_grad_(False)

    def unreachable_parameters(self) -> list[nn.Parameter]:
        """Backbone parameters the action loss never reaches: the final norm and the last layer's
        post-attention path (the action expert reads only the prefix's keys/values). Kept for
        weight import/export, frozen so DDP/FSDP and the optimizer skip them."""
        last = self.layers[-1].vlm
        return [*self.norm.parameters(), last.self_attn.o_proj.weight,
                *last.post_attention_layernorm.parameters(), *last.mlp.parameters()]

    # -- structure the engine uses ---------------------------------------------------------
    def repeated_blocks(self) -> list[nn.Module]:
        """The repeated blocks: FSDP units, activation-checkpoint and compile targets."""
        return self.prefix.vision_layers() + list(self.layers)

    def set_recompute(self, mode: str) -> None:
        self.activation_checkpointing = mode == "full"

    def _layer(self, layer, *args, **kwargs):
        if self.activation_checkpointing and self.training:
            return checkpoint(layer, *args, use_reentrant=False, **kwargs)
        return layer(*args, **kwargs)

    # -- model ----------------------------------------------------------------------------
    def embed_suffix(self, x_t: torch.Tensor, t: torch.Tensor):
        cfg = self.cfg
        temb = sinusoidal_embedding(t, cfg.expert.width, cfg.min_period, cfg.max_period)
        cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(temb.to(self.time_mlp_in.weight.dtype)))))
        tokens = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype))
        b, n = tokens.shape[:2]
        pad = torch.ones(b, n, dtype=torch.bool, device=tokens.device)
        att = torch.zeros(b, n, dtype=torch.bool, device=tokens.device)
        att[:, 0] = True  # the chunk is one block: it sees the prefix, the prefix never sees it
        return tokens, pad, att, cond

    def velocity(self, batch: dict[str, torch.Tensor], x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predicted velocity ``[B, chunk, max_action_dim]`` (fp32) for one joint forward."""
        prefix, prefix_pad = self.prefix(batch["images"], batch["image_mask"], batch["tokens"], batch["token_mask"])
        suffix, suffix_pad, suffix_att, cond = self.embed_suffix(x_t, t)
        pad = torch.cat([prefix_pad, suffix_pad], 1)
        att = torch.cat([torch.zeros_like(prefix_pad), suffix_att], 1)
        mask = additive_mask(make_att_2d_masks(pad, att))
        positions = torch.cumsum(pad.long(), 1) - 1
        cos, sin = rope_cos_sin(positions, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, prefix.dtype)
        suffix = suffix.to(prefix.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            prefix, suffix, _ = self._layer(layer, prefix, suffix, cos, sin, mask, cond, prefix_output=i < last)
        out, _ = self.expert_norm(suffix, cond)
        return self.action_out_proj(out[:, -self.cfg.chunk_size :]).float()

    def forward(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Per-element flow-matching loss ``[B, chunk, max_action_dim]`` (squared velocity error)."""
        actions = batch["actions"].float()
        v = self.velocity(batch, interpolate(actions, noise, t), t)
        return (velocity_target(actions, noise) - v) ** 2

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, num_steps: int | None = None) -> torch.Tensor:
        """Actions ``[B, chunk, max_action_dim]`` (normalised) by Euler integration from ``noise``."""
        prefix, prefix_pad = self.prefix(batch["images"], batch["image_mask"], batch["tokens"], batch["token_mask"])
        mask = additive_mask(make_att_2d_masks(prefix_pad, torch.zeros_like(prefix_pad)))
        positions = torch.cumsum(prefix_pad.long(), 1) - 1
        dtype = prefix.dtype
        cos, sin = rope_cos_sin(positions, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, dtype)
        cache, last = [], len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            prefix, _, kv = layer(prefix, None, cos, sin, mask, prefix_output=i < last)
            cache.append(kv)
        offset = prefix_pad.long().sum(1, keepdim=True)

        def velocity(x_t, t):
            suffix, suffix_pad, suffix_att, cond = self.embed_suffix(x_t, t)
            b, n = suffix_pad.shape
            allowed = torch.cat([prefix_pad[:, None, :].expand(b, n, -1), make_att_2d_masks(suffix_pad, suffix_att)], 2)
            pos = offset + torch.cumsum(suffix_pad.long(), 1) - 1
            s_cos, s_sin = rope_cos_sin(pos, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, dtype)
            h = suffix.to(dtype)
            for layer, kv in zip(self.layers, cache):
                _, h, _ = layer(None, h, s_cos, s_sin, additive_mask(allowed), cond, prefix_kv=kv)
            out, _ = self.expert_norm(h, cond)
            return self.action_out_proj(out[:, -self.cfg.chunk_size :]).float()

        return euler_integrate(velocity, noise.float(), num_steps or self.cfg.num_inference_steps)


PI05_SPEC = ModelSpec(
    name="pi05",
    config_class=Pi05Config,
    build=Pi05Policy,
    engine="torch",
    task=PolicyTask,
    hf_adapter=LEROBOT_PI05_ADAPTER,
)
