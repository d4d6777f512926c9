"""LeRobot's GR00T N1.7 action head (``lerobot.policies.groot``'s ``GR00TN17ActionHead``) as a table of
the core mapping engine, and the head's fields of LeRobot's ``GR00TN17Config``.

HF-side names are the action head's under a saved ``GrootPolicy``'s ``_groot_model.action_head.``
(``_groot_model.`` is the policy prefix; ``action_head.`` names the head in ``GR00TN17``); LF-side
names are ``GrootN17Policy.action_head``'s, the same below that. Every head tensor maps one to one.
The layout covers the head only (``covers``): GR00T's backbone (``_groot_model.backbone.*``,
Cosmos-Reason2-2B) has no counterpart in ``GrootN17Policy``, whose backbone is this package's
SigLIP + Gemma; import leaves GR00T's backbone out and export writes the head alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.core.hf_mapping import HFMapping, MappingError, Rule
from loongforge.embodied.convert.lerobot_layout import LeRobotAdapter, WB

HEAD = "action_head."
_ATTN = tuple(f"attn1.{p}.{w}" for p in ("to_q", "to_k", "to_v", "to_out.0") for w in WB)
_FF = tuple(f"ff.net.{p}.{w}" for p in ("0.proj", "2") for w in WB)
DIT_BLOCK = (*(f"norm1.linear.{w}" for w in WB), *_ATTN, *_FF)  # adaLN blocks: norm3 has no parameters
VL_BLOCK = (*(f"norm{i}.{w}" for i in (1, 3) for w in WB), *_ATTN, *_FF)
TOP = (*(f"model.timestep_encoder.timestep_embedder.linear_{i}.{w}" for i in (1, 2) for w in WB),
       *(f"model.proj_out_{i}.{w}" for i in (1, 2) for w in WB),
       *(f"{m}.layer{i}.{p}" for m in ("state_encoder", "action_decoder") for i in (1, 2) for p in ("W", "b")),
       *(f"action_encoder.W{i}.{p}" for i in (1, 2, 3) for p in ("W", "b")),
       *(f"vlln.{w}" for w in WB), "position_embedding.weight")

GROOT_MAPPING = HFMapping(
    rules=(
        *(Rule(HEAD + n, HEAD + n) for n in TOP),
        *(Rule(HEAD + "model.transformer_blocks.{dit}." + n, HEAD + "model.transformer_blocks.{dit}." + n) for n in DIT_BLOCK),
        *(Rule(HEAD + "vl_self_attention.transformer_blocks.{vl}." + n, HEAD + "vl_self_attention.transformer_blocks.{vl}." + n)
          for n in VL_BLOCK),
    ),
    ranges={"dit": "dit", "vl": "vl"},
)


@dataclass(frozen=True)
class GrootLayout:
    """The numbers that fix the head's names: DiT blocks and backbone self-attention blocks."""

    dit: int
    vl: int


# LeRobot GR00TN17Config key -> GrootHeadConfig field, the same value on both sides
HEAD_KEYS = {"hidden_size": "hidden_size", "input_embedding_dim": "input_embedding_dim", "max_seq_len": "max_seq_len",
             "max_num_embodiments": "max_num_embodiments", "num_timestep_buckets": "num_timestep_buckets",
             "state_dropout_prob": "state_dropout_prob", "attend_text_every_n_blocks": "attend_text_every_n_blocks"}
DIT_KEYS = {"num_layers": "dit_layers", "num_attention_heads": "dit_heads", "attention_head_dim": "dit_head_dim",
            "dropout": "dropout"}
VL_KEYS = {"num_layers": "vl_layers", "num_attention_heads": "vl_heads", "attention_head_dim": "vl_head_dim"}
# what GrootActionHead builds, as LeRobot's GR00TN17Config spells it
BUILT = {"use_alternate_vl_dit": True, "add_pos_embed": True, "use_vlln": True, "state_history_length": 1}


def head_config_from_lerobot(raw: dict):
    """The action head fields of a LeRobot ``GR00TN17Config`` (a dict) -> ``GrootHeadConfig``."""
    from loongforge.embodied.policies.groot_action_head import GrootHeadConfig

    source = "LeRobot GR00T N1.7 config"
    for key, needed in BUILT.items():
        if raw.get(key, needed) != needed:
            raise MappingError(f"{source}: {key}={raw[key]!r}; the groot_n1_7 family builds {key}={needed!r}")
    dit, vl = raw.get("diffusion_model_cfg") or {}, raw.get("vl_self_attention_cfg") or {}
    for part, cfg in (("diffusion_model_cfg", dit), ("vl_self_attention_cfg", vl)):
        if cfg.get("positional_embeddings") is not None:
            raise MappingError(f"{source}: {part}.positional_embeddings={cfg['positional_embeddings']!r}; only None")
    if dit.get("output_dim", raw.get("hidden_size")) != raw.get("hidden_size"):
        raise MappingError(f"{source}: diffusion_model_cfg.output_dim={dit['output_dim']}; must equal hidden_size")
    try:
        return GrootHeadConfig(**{ours: raw[k] for k, ours in HEAD_KEYS.items() if k in raw},
                               **{ours: dit[k] for k, ours in DIT_KEYS.items() if k in dit},
                               **{ours: vl.get(k, 0) for k, ours in VL_KEYS.items() if k in vl or k == "num_layers"})
    except ValueError as exc:
        raise MappingError(f"{source}: {exc}") from exc


def head_config_to_lerobot(head) -> dict:
    """``GrootHeadConfig`` -> the action head fields of LeRobot's ``GR00TN17Config``."""
    return {**{k: getattr(head, ours) for k, ours in HEAD_KEYS.items()}, **BUILT,
            "diffusion_model_cfg": {**{k: getattr(head, ours) for k, ours in DIT_KEYS.items()}, "positional_embeddings": None,
                                    "norm_type": "ada_norm", "final_dropout": True, "output_dim": head.hidden_size,
                                    "interleave_self_attention": True},
            "vl_self_attention_cfg": {**{k: getattr(head, ours) for k, ours in VL_KEYS.items()}, "positional_embeddings": None,
                                      "dropout": head.dropout, "final_dropout": True}}


def config_from_lerobot(raw: dict):
    """A LeRobot ``GR00TN17Config`` (a dict) -> ``GrootN17Config`` with that head; the backbone
    stays this package's (its fields at their defaults; ``max_state_dim``/``max_action_dim`` and
    the chunk from the config)."""
    from loongforge.embodied.config import policy_config_class  # the family's class, through the registry

    for key in ("max_state_dim", "max_action_dim", "action_horizon"):
        if key not in raw:
            raise MappingError(f"LeRobot GR00T N1.7 config: no {key!r}")
    fields: dict[str, Any] = dict(head=head_config_from_lerobot(raw), max_state_dim=raw["max_state_dim"],
                                  max_action_dim=raw["max_action_dim"], chunk_size=raw["action_horizon"],
                                  num_inference_steps=raw.get("num_inference_timesteps", 4))
    return policy_config_class("groot_n1_7")(**fields)


def config_to_lerobot(cfg) -> dict:
    """``GrootN17Config`` -> the action head's fields of LeRobot's ``GR00TN17Config``."""
    return {"model_type": "Gr00tN1d7", **head_config_to_lerobot(cfg.head), "max_state_dim": cfg.max_state_dim,
            "max_action_dim": cfg.max_action_dim, "action_horizon": cfg.chunk_size,
            "num_inference_timesteps": cfg.num_inference_steps, "backbone_embedding_dim": cfg.vlm.width}


@dataclass(frozen=True)
class GrootAdapter(LeRobotAdapter):
    """The groot_n1_7 family's LeRobot adapter: GR00T N1.7's action head (``covers`` the head only)."""

    def layout(self, cfg) -> GrootLayout:
        return cfg if isinstance(cfg, GrootLayout) else GrootLayout(cfg.head.dit_layers, cfg.head.vl_layers)

    def layout_from_state(self, state, side: str) -> GrootLayout:
        counts = self.mapping.counts_in(list(state), side=side)
        return GrootLayout(counts["dit"], counts["vl"])

    def recognises(self, bare_names: list[str]) -> bool:
        return any(n.startswith(HEAD + "model.transformer_blocks.") for n in bare_names)

    def covers(self, name: str) -> bool:
        return name.startswith(HEAD)


LEROBOT_GROOT_ADAPTER = GrootAdapter(architectures=(), mapping=GROOT_MAPPING, config_from_hf=config_from_lerobot,
                                     config_to_hf=config_to_lerobot, policy_class="GrootPolicy",
                                     policy_prefix="_groot_model.", lerobot_type="groot")
