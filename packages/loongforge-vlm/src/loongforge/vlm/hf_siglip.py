"""SigLIP's vision tower from a Hugging Face directory into the ``siglip_vit`` encoder (and back).

One declarative table maps transformers' ``SiglipVisionModel`` (``embeddings.patch_embedding``
as a ``Conv2d``, ``embeddings.position_embedding``, ``encoder.layers.N.{layer_norm1, self_attn.
{q,k,v,out}_proj, layer_norm2, mlp.fc1/fc2}``, ``post_layernorm``) onto the encoder's megatron
names. The tower is found in a directory of:

- ``SiglipVisionModel`` / ``SiglipModel`` (``google/siglip-so400m-patch14-384``; the text tower,
  ``logit_scale`` and ``logit_bias`` are not read): tensors under ``vision_model.`` (or unprefixed,
  as transformers 5 saves a ``SiglipVisionModel``);
- ``LlavaOnevisionForConditionalGeneration``: tensors under ``vision_tower.vision_model.`` (the
  ``-hf`` checkpoints), ``vision_tower.`` or ``model.vision_tower.[vision_model.]``; only the
  vision tower is read (not the projector, the language model or ``image_newline``). LLaVA-OneVision
  feeds its projector the last layer's output before ``post_layernorm``
  (``vision_feature_layer=-1``), so its tower reads into an encoder with ``post_norm: false``.

SigLIP's attention-pooling ``head`` (``head.*``: the contrastive image embedding) is no part of a
VLM's tower: it is skipped on import and not written on export. Every other tensor under the
tower's prefix must be mapped: one that is not is an error naming it.

``encoder.init_from_hf=DIR`` (``SigLIPViTConfig``) loads the tower at training start
(``VLMTask.build_model``); ``save_tower`` writes an (unsharded) encoder as a ``SiglipVisionModel``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

import loongforge.vlm.hf  # noqa: F401  (registers the ViT transform the table names: vit_conv2d_patch_embedding)
import loongforge.vlm.hf_internvl  # noqa: F401  (registers vit_separate_qkv)
from loongforge.core.hf_mapping import BoundMapping, HFMapping, Ignore, MappingError, Rule

ARCHITECTURES = ("SiglipVisionModel", "SiglipModel", "LlavaOnevisionForConditionalGeneration")
EXPORT_ARCHITECTURE = "SiglipVisionModel"
HIDDEN_ACT = "gelu_pytorch_tanh"  # the encoder's gelu_tanh
# where each architecture's checkpoints keep the tower, first match wins
TOWER_PREFIXES = {
    "SiglipVisionModel": ("vision_model.", ""),
    "SiglipModel": ("vision_model.",),
    "LlavaOnevisionForConditionalGeneration": ("vision_tower.vision_model.", "vision_tower.",
                                               "model.vision_tower.vision_model.", "model.vision_tower."),
}
HEAD = ("probe", "attention.in_proj_weight", "attention.in_proj_bias", "attention.out_proj.weight",
        "attention.out_proj.bias", "layernorm.weight", "layernorm.bias", "mlp.fc1.weight", "mlp.fc1.bias",
        "mlp.fc2.weight", "mlp.fc2.bias")
# the LLaVA-OneVision settings under which its projector reads the tower's last layer, every patch
LLAVA_ONEVISION_FIXED = {"vision_feature_layer": -1, "vision_feature_select_strategy": "full"}

_LAYER_HF, _LAYER = "encoder.layers.{layer}.", "decoder.layers.{layer}."
_QKV = tuple(_LAYER_HF + f"self_attn.{x}_proj." for x in "qkv")

SIGLIP_VISION_MAPPING = HFMapping(
    rules=(
        Rule("embeddings.patch_embedding.weight", "patch_embed.weight", "vit_conv2d_patch_embedding"),
        Rule("embeddings.patch_embedding.bias", "patch_embed.bias"),
        Rule("embeddings.position_embedding.weight", "position_embedding"),
        *(Rule(_LAYER_HF + f"layer_norm1.{p}", _LAYER + f"self_attention.linear_qkv.layer_norm_{p}")
          for p in ("weight", "bias")),
        *(Rule(tuple(q + p for q in _QKV), _LAYER + f"self_attention.linear_qkv.{p}", "vit_separate_qkv")
          for p in ("weight", "bias")),
        *(Rule(_LAYER_HF + f"self_attn.out_proj.{p}", _LAYER + f"self_attention.linear_proj.{p}")
          for p in ("weight", "bias")),
        *(Rule(_LAYER_HF + f"layer_norm2.{p}", _LAYER + f"mlp.linear_fc1.layer_norm_{p}") for p in ("weight", "bias")),
        *(Rule(_LAYER_HF + f"mlp.fc{n}.{p}", _LAYER + f"mlp.linear_fc{n}.{p}") for n in (1, 2) for p in ("weight", "bias")),
        *(Rule(f"post_layernorm.{p}", f"decoder.final_layernorm.{p}", when="post_norm") for p in ("weight", "bias")),
    ),
    ranges={"layer": "num_layers"},
    stacked=(("decoder.layers.{layer}.", "decoder.layers."),),
    ignore=(*(Ignore(f"head.{name}") for name in HEAD),  # the attention-pooling head: not a VLM tower's
            *(Ignore(f"post_layernorm.{p}", when="not post_norm") for p in ("weight", "bias"))),
)


@dataclass(frozen=True)
class SigLIPTower:
    """The SigLIP vision tower of an HF directory: the architecture it was saved as, the prefix of
    its tensors, and the encoder settings its ``config.json`` gives (``encoder.*`` keys)."""

    directory: Path
    architecture: str
    prefix: str
    encoder: dict

    def bind(self, cfg) -> BoundMapping:
        """The table bound to the encoder config ``cfg``, under the tower's prefix; every tensor
        outside the prefix (a text tower, a projector, a language model) is left unread."""
        bound = SIGLIP_VISION_MAPPING.bind(cfg).prefixed(hf=self.prefix)
        if not self.prefix:
            return bound
        outside = re.compile(rf"(?!{re.escape(self.prefix)})")  # matches (empty) every name not under the prefix
        return bound + BoundMapping([], {}, (outside,))

    def check(self, cfg, key: str = "encoder.init_from_hf") -> None:
        """The encoder config must be the tower's architecture: a mismatch is one error naming
        every differing ``encoder.*`` key and the value the directory needs."""
        from loongforge.core.config import ConfigError

        if cfg.family != "siglip_vit":
            raise ConfigError(f"{key}={self.directory}: a SigLIP tower loads into encoder.family=siglip_vit, "
                              f"not {cfg.family!r}")
        wrong = {k: v for k, v in self.encoder.items() if getattr(cfg, k) != v}
        if wrong:
            have = ", ".join(f"encoder.{k}={getattr(cfg, k)!r}" for k in wrong)
            need = " ".join(f"encoder.{k}={json.dumps(v)}" for k, v in wrong.items())
            raise ConfigError(f"{key}={self.directory}: {have} differ from the {self.architecture} tower in "
                              f"{self.directory / 'config.json'}; set {need}")


def _vision_config(raw: dict, architecture: str, source: str):
    """transformers' ``SiglipVisionConfig`` of ``raw`` (its defaults filled in)."""
    from transformers import SiglipVisionConfig

    vision = raw if architecture == "SiglipVisionModel" else raw.get("vision_config")
    if not isinstance(vision, dict):
        raise MappingError(f"{source}: {architecture} without a vision_config")
    kind = vision.get("model_type", "siglip_vision_model")
    if kind != "siglip_vision_model":
        raise MappingError(f"{source}: vision_config.model_type={kind!r}: only a SigLIP tower (siglip_vision_model) "
                           f"loads into siglip_vit")
    return SiglipVisionConfig.from_dict({k: v for k, v in vision.items() if k != "architectures"})


def encoder_settings(vision, post_norm: bool, source: str) -> dict:
    """``encoder.*`` settings of a ``SiglipVisionConfig``. ``image_size`` is the part of the image
    the patch convolution covers (384 px of 14 px patches: 378, the 27x27 position grid)."""
    if vision.hidden_act != HIDDEN_ACT:
        raise MappingError(f"{source}: vision_config.hidden_act={vision.hidden_act!r}: siglip_vit computes {HIDDEN_ACT}")
    patch = int(vision.patch_size)
    return dict(num_layers=int(vision.num_hidden_layers), hidden_size=int(vision.hidden_size),
                num_attention_heads=int(vision.num_attention_heads), ffn_hidden_size=int(vision.intermediate_size),
                in_channels=int(vision.num_channels), patch_size=patch, temporal_patch_size=1,
                image_size=int(vision.image_size) // patch * patch, norm_epsilon=float(vision.layer_norm_eps),
                post_norm=post_norm)


def read_tower(directory: str | Path) -> SigLIPTower:
    """The SigLIP tower of an HF directory (``MappingError`` naming the file and key otherwise)."""
    from loongforge.core.hf_mapping.hf_dir import HFReader

    hf = HFReader(directory)
    source = str(hf.directory / "config.json")
    archs = hf.config.get("architectures") or []
    architecture = next((a for a in archs if a in ARCHITECTURES), None)
    if architecture is None:
        raise MappingError(f"{source}: architectures {archs!r}: a SigLIP tower comes from one of {', '.join(ARCHITECTURES)}")
    post_norm = True
    if architecture == "LlavaOnevisionForConditionalGeneration":
        for key, needed in LLAVA_ONEVISION_FIXED.items():
            if hf.config.get(key, needed) != needed:
                raise MappingError(f"{source}: {key}={hf.config[key]!r}: siglip_vit gives the tower's last layer for "
                                   f"every patch ({key}={needed!r})")
        post_norm = False  # hidden_states[-1]: before post_layernorm
    vision = _vision_config(hf.config, architecture, source)
    names = set(hf.names())
    prefix = next((p for p in TOWER_PREFIXES[architecture] if p + "embeddings.patch_embedding.weight" in names), None)
    if prefix is None:
        tried = ", ".join(repr(p + "embeddings.patch_embedding.weight") for p in TOWER_PREFIXES[architecture])
        raise MappingError(f"{hf.directory}: no SigLIP tower in the safetensors (looked for {tried})")
    return SigLIPTower(hf.directory, architecture, prefix, encoder_settings(vision, post_norm, source))


def refuse_whole_conversion(directory: str | Path) -> None:
    """``lf-vlm convert hf-to-lf`` of a directory whose only part LoongForge reads is its SigLIP
    tower: a ``MappingError`` saying how to use the tower instead (LLaVA-OneVision's anyres tiling
    and ``image_newline`` have no LoongForge counterpart, so its whole checkpoint is not converted)."""
    path = Path(directory) / "config.json"
    try:
        archs = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return  # the converter reports a missing or bad config.json
    architecture = next((a for a in archs if a in ARCHITECTURES), None)
    if architecture is None:
        return
    extra = (" encoder.post_norm=false (its projector reads the tower before post_layernorm); the whole checkpoint "
             "is not converted: anyres tiling and image_newline have no LoongForge counterpart"
             if architecture == "LlavaOnevisionForConditionalGeneration" else "")
    raise MappingError(f"{path}: {architecture}: LoongForge reads its SigLIP vision tower only; start a siglip_vit "
                       f"encoder from it with encoder.init_from_hf={directory}{extra}")


def checked_tower(cfg, directory: str | Path, key: str = "encoder.init_from_hf") -> SigLIPTower:
    """The SigLIP tower of ``directory`` (a local directory or a hub id), checked to be the
    architecture of the encoder config ``cfg``; any problem is a ``ConfigError`` naming ``key``."""
    from loongforge.core.config import ConfigError
    from loongforge.core.hub import resolve_local

    try:
        tower = read_tower(resolve_local(str(directory), key=key))
    except MappingError as exc:
        raise ConfigError(f"{key}={directory}: {exc}") from exc
    tower.check(cfg, key)
    return tower


def load_tower(encoder: torch.nn.Module, cfg, source: SigLIPTower | str | Path,
               key: str = "encoder.init_from_hf") -> None:
    """Fill the (TP-sharded) megatron ``encoder`` of config ``cfg`` from a SigLIP tower (one
    ``checked_tower`` gave, or the directory to check it in): each rank reads its shards. A config
    that is not the tower's, a missing or an unmapped tensor is a ``ConfigError`` naming ``key``."""
    from loongforge.core.checkpoint.sharded import load_into
    from loongforge.core.config import ConfigError
    from loongforge.core.hf_mapping.online import HFPieceReader

    tower = source if isinstance(source, SigLIPTower) else checked_tower(cfg, source, key)
    try:
        reader = HFPieceReader(tower.directory, tower.bind(cfg))
        encoder.load_state_dict(load_into(encoder.sharded_state_dict(), reader, {}, {}), strict=True)
    except MappingError as exc:
        raise ConfigError(f"{key}={tower.directory}: {exc}") from exc


def tower_config_to_hf(cfg) -> dict:
    """The encoder config -> a ``SiglipVisionModel`` ``config.json`` (no pooling head)."""
    from transformers import SiglipVisionConfig

    if cfg.family != "siglip_vit":
        raise MappingError(f"encoder.family={cfg.family!r}: {EXPORT_ARCHITECTURE} holds a siglip_vit encoder")
    if not cfg.post_norm:
        raise MappingError(f"encoder.post_norm={cfg.post_norm}: {EXPORT_ARCHITECTURE} always applies post_layernorm")
    hf = SiglipVisionConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                            num_channels=cfg.in_channels, image_size=cfg.image_size, patch_size=cfg.patch_size,
                            hidden_act=HIDDEN_ACT, layer_norm_eps=cfg.norm_epsilon, vision_use_head=False,
                            architectures=[EXPORT_ARCHITECTURE])
    return hf.to_dict()


def _unsharded(encoder: torch.nn.Module) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """(sharded key, stacked offsets) -> tensor of every parameter of an unsharded encoder."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for sh in encoder.sharded_state_dict().values():
        if not isinstance(sh, ShardedTensor):
            continue
        if tuple(sh.local_shape) != tuple(sh.global_shape)[sh.prepend_axis_num:] or sh.flattened_range is not None:
            raise MappingError(f"encoder tensor {sh.key!r} is sharded {list(sh.local_shape)} of "
                               f"{list(sh.global_shape)}: save_tower writes an encoder with tp=1")
        out[sh.key, tuple(sh.global_offset[:sh.prepend_axis_num])] = sh.data
    return out


def save_tower(encoder: torch.nn.Module, cfg, out: str | Path) -> Path:
    """Write an unsharded ``siglip_vit`` encoder as a ``SiglipVisionModel`` directory ``out`` (which
    must not exist; the names transformers saves), through core's ``HFWriter``: written aside and
    published whole, so a failed write leaves nothing at ``out``."""
    from loongforge.core.hf_mapping.hf_dir import HFWriter

    config = tower_config_to_hf(cfg)
    bound = SIGLIP_VISION_MAPPING.bind(cfg)
    tensors = _unsharded(encoder)

    def get(name: str) -> torch.Tensor:
        loc = bound.location(name)
        return tensors[loc.key, tuple(loc.offsets)]

    writer = HFWriter(out)
    try:
        for name, tensor in bound.to_hf(get):
            writer.add(name, tensor)
        return writer.finish(config)
    except BaseException:
        writer.abort()
        raise
