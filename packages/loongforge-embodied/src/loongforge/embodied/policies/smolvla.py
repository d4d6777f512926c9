"""SmolVLA: SmolVLM's vision tower and first Llama layers with an interleaved action expert.

The prefix is every camera's image tokens (SmolVLM's vision transformer, its pixel-shuffle
connector, scaled by sqrt(width)), the instruction's token embeddings (scaled likewise) and one
continuous state token (``state_proj``, a block of its own: the images and the prompt never see
it). The suffix is the noisy action chunk fused with the sinusoidal flow-matching time by an
MLP (linear, swish, linear); each action token is a causal block of its own. The layers are
``smolvlm_expert``'s: joint attention every ``self_attn_every_n_layers``-th layer, the expert
cross-attending to the prefix's keys/values in between. The expert's last-norm output at the
chunk's positions is projected to the velocity.

What trains follows LeRobot's flags: ``train_expert_only`` freezes the whole VLM (vision tower,
connector, embeddings, text layers), ``freeze_vision_encoder`` the vision tower,
``train_state_proj=false`` the state projection; the VLM's last layer, final norm and
``lm_head`` (kept only for the LeRobot layout) are always frozen, as in LeRobot.

Parameter names follow LeRobot's ``VLAFlowMatching`` closely enough that
``convert.lerobot_smolvla`` is a table of renames; it is the family's ``hf_adapter``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionTransformer

from loongforge.core.models import ModelSpec
from loongforge.core.training.torch_model import TorchModel
from loongforge.embodied.config import GemmaConfig, positive
from loongforge.embodied.convert.lerobot_smolvla import LEROBOT_SMOLVLA_ADAPTER
from loongforge.embodied.policies.action_expert import ActionExpertConfig, suffix_masks
from loongforge.embodied.policies.flow_matching import euler_integrate, interpolate, sinusoidal_embedding, velocity_target
from loongforge.embodied.policies.layers import additive_mask, embed_scale, init_linear_weights, make_att_2d_masks, rope_cos_sin
from loongforge.embodied.policies.smolvlm_expert import LlamaRMSNorm, SmolVLMExpertLayer
from loongforge.embodied.task import PolicyTask


def _llama(width: int, mlp_dim: int) -> GemmaConfig:
    return GemmaConfig(width=width, depth=4, mlp_dim=mlp_dim, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5)


@dataclass
class SmolVLAConfig(ActionExpertConfig):
    """SmolVLA: SmolVLM (vision tower, pixel-shuffle connector, Llama text layers) with a narrower
    Llama action expert; ``vlm``/``expert`` use the decoder-stack fields (Llama blocks here), and
    agree on heads, head size and depth (``ActionExpertConfig``)."""

    family: str = "smolvla"
    discrete_state: bool = False  # the state enters as one continuous token of the prefix
    vlm: GemmaConfig = field(default_factory=lambda: _llama(64, 128))
    expert: GemmaConfig = field(default_factory=lambda: _llama(48, 256))
    scale_factor: int = 2  # pixel shuffle of the connector: scale_factor^2 patches per image token
    self_attn_every_n_layers: int = 2  # layers 0, n, 2n, ... attend jointly; the others cross-attend
    train_expert_only: bool = True  # freeze the whole VLM (LeRobot's default)
    freeze_vision_encoder: bool = True  # freeze the vision tower
    train_state_proj: bool = True  # train the state projection

    def __post_init__(self):
        super().__post_init__()
        positive("model", self, "scale_factor", "self_attn_every_n_layers")
        if self.discrete_state:
            raise ValueError("model.discrete_state=true: SmolVLA reads the state as a continuous token, not in the prompt")
        side = self.image_size // self.vision.patch_size
        if side % self.scale_factor:
            raise ValueError(f"model.image_size={self.image_size}: {side} patches a side is not a multiple of "
                             f"model.scale_factor={self.scale_factor}")


def vision_config(cfg: SmolVLAConfig) -> SmolVLMVisionConfig:
    v = cfg.vision
    return SmolVLMVisionConfig(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                               num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
                               image_size=cfg.image_size, patch_size=v.patch_size, layer_norm_eps=v.layer_norm_eps,
                               hidden_act="gelu_pytorch_tanh", attn_implementation="sdpa")


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``[B, side*side, D]`` patches -> ``[B, (side/scale)^2, scale*scale*D]``: each output token
    holds a ``scale x scale`` square of patches, row by row."""
    b, n, d = x.shape
    side = int(n**0.5)
    grid = x.view(b, side // scale, scale, side // scale, scale, d)  # [b, R, i, C, j, d]
    return grid.permute(0, 1, 3, 2, 4, 5).reshape(b, n // scale**2, scale * scale * d)


class Connector(nn.Module):
    """SmolVLM's connector: pixel shuffle, then a linear projection into the text width."""

    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.scale_factor = cfg.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(cfg.vision.hidden_size * cfg.scale_factor**2, cfg.vlm.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))


class SmolVLAPolicy(TorchModel):
    family = "smolvla"
    recompute_modes = ("full",)  # train.recompute=full: each repeated block recomputed in the backward
    fsdp_forward_methods = ("sample_actions",)

    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.cfg = cfg
        vlm, expert = cfg.vlm, cfg.expert
        self.vision_model = SmolVLMVisionTransformer(vision_config(cfg))
        self.connector = Connector(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, vlm.width)
        self.layers = nn.ModuleList([SmolVLMExpertLayer(vlm, expert, cross=i % cfg.self_attn_every_n_layers != 0)
                                     for i in range(vlm.depth)])
        self.norm = LlamaRMSNorm(vlm.width, vlm.rms_norm_eps)
        self.expert_norm = LlamaRMSNorm(expert.width, expert.rms_norm_eps)
        self.lm_head = nn.Linear(vlm.width, cfg.vocab_size, bias=False)  # never run: kept for the LeRobot layout
        self.state_proj = nn.Linear(cfg.max_state_dim, vlm.width)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, expert.width)
        self.action_out_proj = nn.Linear(expert.width, cfg.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * expert.width, expert.width)
        self.action_time_mlp_out = nn.Linear(expert.width, expert.width)
        heads = (self.state_proj, self.action_in_proj, self.action_out_proj, self.action_time_mlp_in, self.action_time_mlp_out)
        init_linear_weights(self, skip=(self.vision_model, *heads))  # the heads keep PyTorch's init, as in LeRobot
        for p in self.frozen_parameters():
            p.requires_grad_(False)
        self.activation_checkpointing = False

    def frozen_parameters(self) -> list[nn.Parameter]:
        """What LeRobot's flags freeze, plus what the loss never reaches (the VLM's last layer,
        final norm and lm_head: LeRobot freezes them too)."""
        cfg = self.cfg
        frozen = [*self.layers[-1].vlm.parameters(), *self.norm.parameters(), *self.lm_head.parameters()]
        if cfg.train_expert_only:
            frozen += [*self.vision_model.parameters(), *self.connector.parameters(), *self.embed_tokens.parameters(),
                       *(p for layer in self.layers for p in layer.vlm.parameters())]
        if cfg.freeze_vision_encoder:
            frozen += list(self.vision_model.parameters())
        if not cfg.train_state_proj:
            frozen += list(self.state_proj.parameters())
        return list({id(p): p for p in frozen}.values())

    # -- structure the engine uses ---------------------------------------------------------
    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.vision_model.encoder.layers) + list(self.layers)

    def set_recompute(self, mode: str) -> None:
        self.activation_checkpointing = mode == "full"

    def _layer(self, layer, *args, **kwargs):
        if self.activation_checkpointing and self.training:
            return checkpoint(layer, *args, use_reentrant=False, **kwargs)
        return layer(*args, **kwargs)

    # -- model ----------------------------------------------------------------------------
    def embed_prefix(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Image tokens of every camera, the prompt, the state token: embeddings ``[B, P, W]``,
        validity and block starts ``[B, P]`` (the state token starts a block)."""
        images = batch["images"]
        b, n = images.shape[:2]
        width = self.cfg.vlm.width
        pixels = images.flatten(0, 1).to(self.vision_model.dtype)
        feats = self.connector(self.vision_model(pixel_values=pixels).last_hidden_state)
        p = feats.shape[1]
        img = (feats * torch.tensor(embed_scale(width), dtype=feats.dtype)).reshape(b, n * p, width)
        img_pad = batch["image_mask"][:, :, None].expand(b, n, p).reshape(b, n * p)
        lang = self.embed_tokens(batch["tokens"])
        lang = lang * embed_scale(width)
        state = self.state_proj(batch["state"].to(self.state_proj.weight.dtype))[:, None, :]
        emb = torch.cat([img, lang.to(img.dtype), state.to(img.dtype)], 1)
        ones = torch.ones(b, 1, dtype=torch.bool, device=emb.device)
        pad = torch.cat([img_pad, batch["token_mask"].bool(), ones], 1)
        att = torch.zeros_like(pad)
        att[:, -1] = True
        return emb, pad, att

    def embed_suffix(self, x_t: torch.Tensor, t: torch.Tensor):
        """The chunk's action-time tokens ``[B, chunk, E]``; each a causal block of its own."""
        cfg = self.cfg
        actions = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype))
        temb = sinusoidal_embedding(t, cfg.expert.width, cfg.min_period, cfg.max_period).to(actions.dtype)
        fused = torch.cat([actions, temb[:, None, :].expand_as(actions)], dim=2)
        tokens = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(fused)))
        pad, att = suffix_masks((1,) * tokens.shape[1], tokens.shape[0], tokens.device)
        return tokens, pad, att

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, dtype)

    def _suffix_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple]:
        """RoPE of the suffix in a joint layer (``False``: joint positions) and in a cross layer
        (``True``: positions from 0 within the suffix)."""
        from_zero = positions - positions.min(dim=1, keepdim=True).values
        return {False: self._ropes(positions, dtype), True: self._ropes(from_zero, dtype)}

    def _velocity_out(self, suffix: torch.Tensor) -> torch.Tensor:
        return self.action_out_proj(self.expert_norm(suffix)[:, -self.cfg.chunk_size:].float())

    def velocity(self, batch: dict[str, torch.Tensor], x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predicted velocity ``[B, chunk, max_action_dim]`` (fp32) for one forward of both streams."""
        prefix, prefix_pad, prefix_att = self.embed_prefix(batch)
        suffix, suffix_pad, suffix_att = self.embed_suffix(x_t, t)
        pad, att = torch.cat([prefix_pad, suffix_pad], 1), torch.cat([prefix_att, suffix_att], 1)
        allowed, n = make_att_2d_masks(pad, att), prefix.shape[1]
        masks = {"pp": additive_mask(allowed[:, :n, :n]), "sp": additive_mask(allowed[:, n:, :n]),
                 "ss": additive_mask(allowed[:, n:, n:])}
        positions = torch.cumsum(pad.long(), 1) - 1
        dtype = prefix.dtype
        prefix_rope, suffix_ropes = self._ropes(positions[:, :n], dtype), self._suffix_ropes(positions[:, n:], dtype)
        suffix = suffix.to(dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            prefix, suffix, _ = self._layer(layer, prefix, suffix, prefix_rope, suffix_ropes[layer.cross], masks,
                                            prefix_output=i < last)
        return self._velocity_out(suffix)

    def forward(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Per-element flow-matching loss ``[B, chunk, max_action_dim]`` (squared velocity error)."""
        actions = batch["actions"].float()
        v = self.velocity(batch, interpolate(actions, noise, t), t)
        return (velocity_target(actions, noise) - v) ** 2

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, num_steps: int | None = None) -> torch.Tensor:
        """Actions ``[B, chunk, max_action_dim]`` (normalised) by Euler integration from ``noise``;
        the prefix runs once and its keys/values are cached per layer."""
        prefix, prefix_pad, prefix_att = self.embed_prefix(batch)
        masks = {"pp": additive_mask(make_att_2d_masks(prefix_pad, prefix_att))}
        dtype = prefix.dtype
        prefix_rope = self._ropes(torch.cumsum(prefix_pad.long(), 1) - 1, dtype)
        cache, last = [], len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            prefix, _, kv = layer(prefix, None, prefix_rope, prefix_rope, masks, prefix_output=i < last)
            cache.append(kv)
        offset = prefix_pad.long().sum(1, keepdim=True)

        def velocity(x_t, t):
            suffix, suffix_pad, suffix_att = self.embed_suffix(x_t, t)
            s = suffix.shape[1]
            step_masks = {"sp": additive_mask(prefix_pad[:, None, :].expand(-1, s, -1)),
                          "ss": additive_mask(make_att_2d_masks(suffix_pad, suffix_att))}
            ropes = self._suffix_ropes(offset + torch.cumsum(suffix_pad.long(), 1) - 1, dtype)
            h = suffix.to(dtype)
            for layer, kv in zip(self.layers, cache):
                _, h, _ = layer(None, h, prefix_rope, ropes[layer.cross], step_masks, prefix_kv=kv)
            return self._velocity_out(h)

        return euler_integrate(velocity, noise.float(), num_steps or self.cfg.num_inference_steps)


SMOLVLA_SPEC = ModelSpec(
    name="smolvla",
    config_class=SmolVLAConfig,
    build=SmolVLAPolicy,
    engine="torch",
    task=PolicyTask,
    hf_adapter=LEROBOT_SMOLVLA_ADAPTER,
)
