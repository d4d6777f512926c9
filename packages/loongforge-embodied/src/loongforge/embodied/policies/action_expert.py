"""The PaliGemma-plus-action-expert machinery that Pi0 and Pi0.5 share.

A PaliGemma-style backbone (SigLIP + Gemma, ``PrefixEmbedder``) reads the cameras and the prompt;
a smaller Gemma-style action expert reads the suffix (the noisy action chunk, for Pi0 after a
state token). Layer ``i`` of both attend jointly (``JointLayer``) under one block-causal mask:
the prefix attends bidirectionally within itself and never to the suffix; the suffix's blocks
(``att`` marks where one starts) attend to the prefix and to the blocks before them. The expert's
output at the last ``chunk_size`` positions is projected to the action velocity. Inference runs
the prefix once, caches its keys/values per layer and integrates the velocity with Euler steps.

A family says how its suffix is embedded (``embed_suffix``) and whether the flow-matching time
conditions the expert's norms (``expert_cond_dim``: Pi0.5's adaptive RMSNorm) or not (Pi0).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from loongforge.core.training.torch_model import TorchModel
from loongforge.embodied.config import GemmaConfig, PolicyConfig
from loongforge.embodied.policies.backbone import PrefixEmbedder
from loongforge.embodied.policies.flow_matching import euler_integrate, interpolate, velocity_target
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
class ActionExpertConfig(PolicyConfig):
    """The shared policy fields plus the Gemma action expert, which attends jointly with the
    backbone layer by layer (so both stacks agree on heads, head size and depth)."""

    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=32, mlp_dim=64))

    def __post_init__(self):
        super().__post_init__()
        v, e = self.vlm, self.expert
        if (v.num_heads, v.num_kv_heads, v.head_dim, v.depth) != (e.num_heads, e.num_kv_heads, e.head_dim, e.depth):
            raise ValueError(
                "model.vlm and model.expert must agree on num_heads, num_kv_heads, head_dim and depth "
                f"(the action expert attends jointly with the backbone): vlm={v}, expert={e}"
            )


def suffix_masks(lengths: tuple[int, ...], batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validity and block starts ``[B, sum(lengths)]`` of a suffix of consecutive blocks of the
    given lengths (every token valid; each block attends to itself and the blocks before it)."""
    n = sum(lengths)
    pad = torch.ones(batch, n, dtype=torch.bool, device=device)
    att = torch.zeros(batch, n, dtype=torch.bool, device=device)
    starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)
    att[:, starts] = True
    return pad, att


class ActionExpertPolicy(TorchModel, ABC):
    """Backbone + action expert; a family adds its suffix embedding (``embed_suffix``) and heads,
    then calls ``finish_init``."""

    recompute_modes = ("full",)  # train.recompute=full: each repeated block recomputed in the backward
    fsdp_forward_methods = ("sample_actions",)

    def __init__(self, cfg: ActionExpertConfig, expert_cond_dim: int | None):
        super().__init__()
        self.cfg = cfg
        vlm, expert = cfg.vlm, cfg.expert
        self.prefix = PrefixEmbedder(cfg)
        self.layers = nn.ModuleList([JointLayer(vlm, expert, expert_cond_dim=expert_cond_dim) for _ in range(vlm.depth)])
        self.norm = RMSNorm(vlm.width, vlm.rms_norm_eps)
        self.expert_norm = (AdaRMSNorm(expert.width, expert_cond_dim, expert.rms_norm_eps) if expert_cond_dim
                            else RMSNorm(expert.width, expert.rms_norm_eps))
        self.action_in_proj = nn.Linear(cfg.max_action_dim, expert.width)
        self.action_out_proj = nn.Linear(expert.width, cfg.max_action_dim)
        self.activation_checkpointing = False

    def finish_init(self, keep_init: tuple[nn.Module, ...] = ()) -> None:
        """Initialise the weights (every module registered; the vision tower and ``keep_init``
        keep their own initialisation) and freeze the unreachable ones."""
        init_linear_weights(self, skip=(self.prefix.vision_tower, *keep_init))
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
    @abstractmethod
    def embed_suffix(self, batch: dict[str, torch.Tensor], x_t: torch.Tensor, t: torch.Tensor):
        """``(tokens [B, S, expert width], validity [B, S], block starts [B, S], expert condition or None)``:
        what each policy (Pi0: state token + action-time MLP; Pi0.5: adaRMS time) puts after the prefix."""

    def _velocity_out(self, suffix: torch.Tensor, cond) -> torch.Tensor:
        out, _ = self.expert_norm(suffix, cond)
        return self.action_out_proj(out[:, -self.cfg.chunk_size :]).float()

    def velocity(self, batch: dict[str, torch.Tensor], x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predicted velocity ``[B, chunk, max_action_dim]`` (fp32) for one joint forward."""
        prefix, prefix_pad = self.prefix(batch["images"], batch["image_mask"], batch["tokens"], batch["token_mask"])
        suffix, suffix_pad, suffix_att, cond = self.embed_suffix(batch, x_t, t)
        pad = torch.cat([prefix_pad, suffix_pad], 1)
        att = torch.cat([torch.zeros_like(prefix_pad), suffix_att], 1)
        mask = additive_mask(make_att_2d_masks(pad, att))
        positions = torch.cumsum(pad.long(), 1) - 1
        cos, sin = rope_cos_sin(positions, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, prefix.dtype)
        suffix = suffix.to(prefix.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            prefix, suffix, _ = self._layer(layer, prefix, suffix, cos, sin, mask, cond, prefix_output=i < last)
        return self._velocity_out(suffix, cond)

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
            suffix, suffix_pad, suffix_att, cond = self.embed_suffix(batch, x_t, t)
            b, n = suffix_pad.shape
            allowed = torch.cat([prefix_pad[:, None, :].expand(b, n, -1), make_att_2d_masks(suffix_pad, suffix_att)], 2)
            pos = offset + torch.cumsum(suffix_pad.long(), 1) - 1
            s_cos, s_sin = rope_cos_sin(pos, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, dtype)
            h = suffix.to(dtype)
            for layer, kv in zip(self.layers, cache):
                _, h, _ = layer(None, h, s_cos, s_sin, additive_mask(allowed), cond, prefix_kv=kv)
            return self._velocity_out(h, cond)

        return euler_integrate(velocity, noise.float(), num_steps or self.cfg.num_inference_steps)
