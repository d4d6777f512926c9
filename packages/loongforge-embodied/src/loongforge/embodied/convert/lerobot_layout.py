"""LeRobot policy layouts as tables of the core mapping engine (``loongforge.core.hf_mapping``):
what every family with a LeRobot layout registers (``LeRobotAdapter``, its ``ModelSpec.hf_adapter``:
export, import, ``model.pretrained_format=lerobot`` and the LoRA layout find a family's piece
through the registry, never by name), and the PaliGemma-with-expert table of ``lerobot.policies.pi0``
and ``pi05`` (``PaliGemmaAdapter``).

HF-side names are ``PI0Pytorch``'s / ``PI05Pytorch``'s state-dict names; a saved ``PI0Policy`` /
``PI05Policy`` prefixes every key with ``model.`` (its ``model`` is the ``*Pytorch``), and both
spellings are accepted. LF-side names are ``Pi0Policy``'s / ``Pi05Policy``'s. The two policies share
the backbone (SigLIP tower, projector, Gemma decoder) and the expert's attention and MLP; they differ
in the expert's norms and in their heads, which each family's table adds (``lerobot_mapping``).
Apart from the renames, LeRobot's PaliGemma ``lm_head`` is tied to the token embedding (``Tied``:
read only when a checkpoint lacks the embedding, written as its copy) and its action expert's
``lm_head`` is never used (``Unused``: dropped, written as zeros ``[vocab_size, expert width]``).
A name a table does not know, or a tensor it needs that is missing, is a ``MappingError`` naming it.

A PaliGemma table binds to a ``LeRobotLayout``: the numbers that fix the names (Gemma and SigLIP
depths) and the shapes export writes. ``adapter.layout(policy config)`` gives it for a configured
policy; without a config it is read off the state dict's own names (``layout_from_state``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from loongforge.core.hf_mapping import BoundMapping, HFAdapter, HFMapping, Rule, Tied, Unused

LEROBOT_POLICY_PREFIX = "model."
PG = "paligemma_with_expert.paligemma."
LM = PG + "model.language_model."
VIT = PG + "model.vision_tower."
EXPERT = "paligemma_with_expert.gemma_expert."

WB = ("weight", "bias")
_ATTENTION = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
_MLP = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
# the state-dict names under one layer / module, the same on both sides
VISION_LAYER = (*(f"layer_norm{i}.{p}" for i in (1, 2) for p in WB), *(f"mlp.fc{i}.{p}" for i in (1, 2) for p in WB),
                 *(f"self_attn.{x}_proj.{p}" for x in ("q", "k", "v", "out") for p in WB))
VISION_TOP = ("embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias",
               "embeddings.position_embedding.weight", "post_layernorm.weight", "post_layernorm.bias")
GEMMA_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")  # plain (1 + w) RMSNorms
GEMMA_LAYER = (*GEMMA_NORMS, *_ATTENTION, *_MLP)
EXPERT_ATTENTION_MLP = (*_ATTENTION, *_MLP)


def same_names(*modules: str) -> tuple[str, ...]:
    """The weight and bias of each head module, named alike on both sides."""
    return tuple(f"{m}.{p}" for m in modules for p in WB)


def lerobot_mapping(expert_layer: tuple[str, ...], expert_norm: tuple[str, ...], heads: tuple[str, ...]) -> HFMapping:
    """The table of one LeRobot PaliGemma-with-expert policy: the shared backbone plus the names
    under each expert layer (``expert_layer``), under the expert's final norm (``expert_norm``) and
    of the heads (``heads``, the same on both sides)."""
    return HFMapping(
        rules=(
            *(Rule(VIT + n, "prefix.vision_tower." + n) for n in VISION_TOP),
            *(Rule(VIT + "encoder.layers.{vision_layer}." + n, "prefix.vision_tower.encoder.layers.{vision_layer}." + n)
              for n in VISION_LAYER),
            *(Rule(PG + "model.multi_modal_projector.linear." + p, "prefix.multi_modal_projector." + p) for p in WB),
            Rule(LM + "embed_tokens.weight", "prefix.embed_tokens.weight"),
            *(Rule(LM + "layers.{layer}." + n, "layers.{layer}.vlm." + n) for n in GEMMA_LAYER),
            Rule(LM + "norm.weight", "norm.weight"),
            *(Rule(EXPERT + "model.layers.{layer}." + n, "layers.{layer}.expert." + n) for n in expert_layer),
            *(Rule(EXPERT + "model.norm." + n, "expert_norm." + n) for n in expert_norm),
            *(Rule(n, n) for n in heads),
        ),
        ranges={"layer": "layers", "vision_layer": "vision_layers"},
        tied=(Tied(PG + "lm_head.weight", of=LM + "embed_tokens.weight"),),
        unused=(Unused(EXPERT + "lm_head.weight", shape=("vocab_size", "expert_width"), like="action_in_proj.weight"),),
    )


@dataclass(frozen=True)
class LeRobotLayout:
    """What a table binds to: the joint decoder depth (backbone and expert), the vision depth
    and, for export's zero ``lm_head`` only, the vocabulary size and the expert width."""

    layers: int
    vision_layers: int
    vocab_size: int | None = None
    expert_width: int | None = None


def _rows(state, name: str) -> int | None:
    return int(state[name].shape[0]) if isinstance(state, Mapping) and name in state else None


@dataclass(frozen=True)
class LeRobotAdapter(HFAdapter, ABC):
    """The adapter of a policy family with a LeRobot layout (its ``ModelSpec.hf_adapter``): the
    family's table, ``config.json`` translation and the few facts conversion needs, so export,
    import and ``model.pretrained_format=lerobot`` work for any registered family alike.
    ``architectures`` is empty: LeRobot's ``config.json`` names a policy ``type``, not a
    transformers architecture, so ``hf_to_lf`` never picks a policy family. ``policy_prefix`` is what
    a saved LeRobot policy puts before its inner model's names; ``policy_class`` its class name."""

    policy_class: str = ""
    policy_prefix: str = LEROBOT_POLICY_PREFIX
    lerobot_type: str = ""  # the ``type`` of a saved LeRobot policy's config.json

    @abstractmethod
    def layout(self, cfg):
        """What the table binds to for a policy config of this family."""

    @abstractmethod
    def layout_from_state(self, state, side: str):
        """What the table binds to, read off a state dict (or just its names) of ``side``
        (``"hf"``: bare LeRobot names, ``"lf"``: LoongForge names)."""

    @abstractmethod
    def recognises(self, bare_names: list[str]) -> bool:
        """Whether a LeRobot state dict with these (unprefixed) names is this family's."""

    def covers(self, name: str) -> bool:
        """Whether the layout holds the tensor ``name`` (the same below the policy prefix on both
        sides); every tensor by default. A family whose LeRobot counterpart is only a part of it
        (GR00T's action head) says which."""
        return True

    def bind(self, cfg) -> BoundMapping:
        return self.mapping.bind(self.layout(cfg))


@dataclass(frozen=True)
class PaliGemmaAdapter(LeRobotAdapter):
    """Pi0 and Pi0.5 (``PaliGemmaWithExpertModel``): bound to the Gemma and SigLIP depths; a
    state dict is the family's when it holds ``marker`` (a head only that family has)."""

    marker: str = ""

    def layout(self, cfg) -> LeRobotLayout:
        return cfg if isinstance(cfg, LeRobotLayout) else LeRobotLayout(
            cfg.vlm.depth, cfg.vision.num_layers, cfg.vocab_size, cfg.expert.width)

    def layout_from_state(self, state, side: str) -> LeRobotLayout:
        counts = self.mapping.counts_in(list(state), side=side)
        if side == "hf":
            return LeRobotLayout(counts["layer"], counts["vision_layer"])
        return LeRobotLayout(counts["layer"], counts["vision_layer"], _rows(state, "prefix.embed_tokens.weight"),
                             _rows(state, "action_in_proj.weight"))

    def recognises(self, bare_names: list[str]) -> bool:
        return any(n.startswith(PG) for n in bare_names) and any(n.startswith(self.marker) for n in bare_names)


def from_lerobot(adapter: LeRobotAdapter, state_dict: Mapping[str, torch.Tensor], cfg=None, *, partial: bool = False,
                 source: str = "LeRobot state dict") -> dict[str, torch.Tensor]:
    """A LeRobot policy state dict (with the family's policy prefix or bare) in LoongForge names,
    for the policy config ``cfg`` (default: the layout its names show). ``partial`` converts the
    tensors that are there (gradients of a subset of parameters) instead of requiring all of them."""
    bare = {k.removeprefix(adapter.policy_prefix): v for k, v in state_dict.items()}
    bare = {k: v for k, v in bare.items() if adapter.covers(k)}
    bound = adapter.mapping.bind(adapter.layout(cfg) if cfg is not None else adapter.layout_from_state(bare, "hf"))
    bound.check_hf(bare, source=source, partial=partial)
    return dict(bound.to_lf(bare.__getitem__, bare, partial=partial))


def to_lerobot(adapter: LeRobotAdapter, state_dict: Mapping[str, torch.Tensor], cfg=None, policy_prefix: bool = True,
               source: str = "LoongForge policy state dict") -> dict[str, torch.Tensor]:
    """Policy weights in LeRobot's names (prefixed like a saved LeRobot policy, bare like its inner
    model with ``policy_prefix=False``), for the policy config ``cfg`` (default: the layout its
    names and shapes show)."""
    state_dict = {k: v for k, v in state_dict.items() if adapter.covers(k)}
    bound = adapter.mapping.bind(adapter.layout(cfg) if cfg is not None else adapter.layout_from_state(state_dict, "lf"))
    bound.check_lf(state_dict, source=source)
    prefix = adapter.policy_prefix if policy_prefix else ""
    return {prefix + name: tensor for name, tensor in bound.to_hf(state_dict.__getitem__)}


def lerobot_adapter(family: str) -> LeRobotAdapter | None:
    """The LeRobot adapter the policy family registers (its ``ModelSpec.hf_adapter``), else None."""
    from loongforge.core.models import get_model_spec

    adapter = get_model_spec(family).hf_adapter
    return adapter if isinstance(adapter, LeRobotAdapter) else None


def lerobot_families() -> dict[str, LeRobotAdapter]:
    """Every installed policy family with a LeRobot layout, by name."""
    from loongforge.core.models import installed_models

    return {name: spec.hf_adapter for name, spec in sorted(installed_models().items())
            if isinstance(spec.hf_adapter, LeRobotAdapter)}


def lerobot_family(names, source: str, lerobot_type: str | None = None) -> tuple[str, LeRobotAdapter]:
    """The installed family whose LeRobot layout a state dict's names are of (of those whose
    ``lerobot_type`` is the saved policy's ``type``, when its config.json gives one)."""
    from loongforge.core.hf_mapping import MappingError

    names = list(names)
    if lerobot_type is not None:
        typed = {f: a for f, a in lerobot_families().items() if a.lerobot_type == lerobot_type}
        if not typed:
            known = ", ".join(sorted({a.lerobot_type for a in lerobot_families().values()}))
            raise MappingError(f"{source}: type={lerobot_type!r}; LeRobot policy types with a layout here: {known}")
        found = [(f, a) for f, a in typed.items() if a.recognises([n.removeprefix(a.policy_prefix) for n in names])]
        if len(found) == 1:
            return found[0]
        raise MappingError(f"{source}: its tensor names are not those of a LeRobot {lerobot_type} policy")
    found = [(family, adapter) for family, adapter in lerobot_families().items()
             if adapter.recognises([n.removeprefix(adapter.policy_prefix) for n in names])]
    if len(found) != 1:
        known = ", ".join(f"{a.policy_class} ({f})" for f, a in lerobot_families().items())
        what = "no" if not found else "more than one"
        raise MappingError(f"{source}: {what} installed policy family has these tensor names; LeRobot policies with "
                           f"a layout here: {known}")
    return found[0]
