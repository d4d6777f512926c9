"""GR00T N1.7's action head on this package's SigLIP + Gemma backbone.

The head (``groot_action_head.GrootActionHead``) is GR00T N1.7's, module for module and name for
name (LeRobot's ``GR00TN17ActionHead``); ``convert.lerobot_groot`` maps it to and from a LeRobot
``GrootPolicy``'s ``_groot_model.action_head.*``. The backbone is not GR00T's: N1.7 reads the
hidden states of NVIDIA's Cosmos-Reason2-2B (a Qwen3-VL model, with its own image processor and
multimodal RoPE), which LeRobot loads from the hub; here the hidden states of layer
``model.vlm_layer`` of the SigLIP + Gemma backbone (``PrefixEmbedder``, ``JointLayer``, as Pi0.5's
prefix) stand in, with the image tokens first (the DiT's image cross-attention reads them) and
the prompt after (its text cross-attention).

Flow matching in GR00T's direction (``tau = 1 - t``: 1 is data): the loss is the squared error
of the head's velocity against ``actions - noise``, at the same ``x_t`` and with the same time
distribution as the rest of the package (``tau = (1 - Beta(1.5, 1)) * 0.999``); sampling integrates
from ``tau = 0`` (noise) in ``num_inference_steps`` Euler steps, as GR00T's ``get_action``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from loongforge.core.models import ModelSpec
from loongforge.core.training.torch_model import TorchModel
from loongforge.embodied.config import PolicyConfig
from loongforge.embodied.convert.lerobot_groot import LEROBOT_GROOT_ADAPTER
from loongforge.embodied.policies.backbone import PrefixEmbedder
from loongforge.embodied.policies.flow_matching import interpolate
from loongforge.embodied.policies.groot_action_head import GrootActionHead, GrootHeadConfig
from loongforge.embodied.policies.layers import JointLayer, additive_mask, init_linear_weights, make_att_2d_masks, rope_cos_sin
from loongforge.embodied.task import PolicyTask


@dataclass
class GrootN17Config(PolicyConfig):
    """GR00T N1.7: the shared policy fields (the backbone) plus GR00T N1.7's action head."""

    family: str = "groot_n1_7"
    discrete_state: bool = False  # the state enters through the head's state encoder
    vlm_layer: int = -1  # backbone layer whose hidden states the head reads (-1 = last)
    head: GrootHeadConfig = field(default_factory=GrootHeadConfig)

    def __post_init__(self):
        super().__post_init__()
        if not -self.vlm.depth <= self.vlm_layer < self.vlm.depth:
            raise ValueError(f"model.vlm_layer={self.vlm_layer}: out of range for model.vlm.depth={self.vlm.depth}")
        if self.time_sampling != "beta" or abs(self.time_offset + self.time_scale - 1.0) > 1e-9:
            raise ValueError("model.time_sampling, time_scale, time_offset: GR00T draws tau = (1 - Beta) * s, "
                             "i.e. time_sampling=beta with time_scale + time_offset = 1")


class GrootN17Policy(TorchModel):
    family = "groot_n1_7"
    recompute_modes = ("full",)  # train.recompute=full: each repeated block recomputed in the backward
    fsdp_forward_methods = ("sample_actions",)

    def __init__(self, cfg: GrootN17Config):
        super().__init__()
        self.cfg = cfg
        self.prefix = PrefixEmbedder(cfg)
        self.layers = nn.ModuleList([JointLayer(cfg.vlm) for _ in range(cfg.vlm_layer % cfg.vlm.depth + 1)])
        init_linear_weights(self, skip=(self.prefix.vision_tower,))
        # the head keeps GR00T's own initialisation (PyTorch's, 0.02-normal embodiment weights)
        self.action_head = GrootActionHead(cfg.head, cfg.vlm.width, cfg.max_state_dim, cfg.max_action_dim)
        self.activation_checkpointing = False

    def repeated_blocks(self) -> list[nn.Module]:
        return self.prefix.vision_layers() + list(self.layers) + self.action_head.repeated_blocks()

    def set_recompute(self, mode: str) -> None:
        self.activation_checkpointing = mode == "full"

    def _block(self, block, *args):
        if self.activation_checkpointing and self.training:
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def features(self, batch: dict[str, torch.Tensor]):
        """Backbone hidden states ``[B, T, W]``, their validity and which are image tokens ``[B, T]``."""
        h, pad = self.prefix(batch["images"], batch["image_mask"], batch["tokens"], batch["token_mask"])
        mask = additive_mask(make_att_2d_masks(pad, torch.zeros_like(pad)))
        cos, sin = rope_cos_sin(torch.cumsum(pad.long(), 1) - 1, self.cfg.vlm.head_dim, self.cfg.vlm.rope_theta, h.dtype)
        for layer in self.layers:
            h, _, _ = self._block(layer, h, None, cos, sin, mask)
        image = torch.zeros_like(pad)
        image[:, : h.shape[1] - batch["tokens"].shape[1]] = True
        return h, pad, image

    def forward(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Per-element flow-matching loss ``[B, chunk, max_action_dim]``: GR00T's velocity against
        ``actions - noise`` at ``x = (1 - tau) noise + tau actions``, ``tau = 1 - t``."""
        actions = batch["actions"].float()
        h, pad, image = self.features(batch)
        feats, state = self.action_head.encode(h, batch["state"], self._block)
        tau = 1 - t
        v = self.action_head.velocity(feats, state, interpolate(actions, noise, t), self.action_head.buckets(tau), image,
                                      pad, self._block)
        return (v.float() - (actions - noise)) ** 2

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], noise: torch.Tensor, num_steps: int | None = None) -> torch.Tensor:
        """Actions ``[B, chunk, max_action_dim]`` (normalised): Euler from ``tau = 0`` (``noise``) to 1."""
        n = num_steps or self.cfg.num_inference_steps
        h, pad, image = self.features(batch)
        feats, state = self.action_head.encode(h, batch["state"])
        x = noise.float()
        for step in range(n):
            buckets = torch.full((x.shape[0],), int(step / n * self.cfg.head.num_timestep_buckets), device=x.device)
            x = x + (1.0 / n) * self.action_head.velocity(feats, state, x, buckets, image, pad).float()
        return x


GROOT_N1_7_SPEC = ModelSpec(
    name="groot_n1_7",
    config_class=GrootN17Config,
    build=GrootN17Policy,
    engine="torch",
    task=PolicyTask,
    hf_adapter=LEROBOT_GROOT_ADAPTER,
)
