"""Declarative Hugging Face <-> LoongForge state-dict mapping.

A family describes its HF layout once, as a table; the engine expands it for a model config
and converts tensor by tensor in either direction, bitwise round trip::

    from loongforge.core.hf_mapping import HFMapping, Ignore, Rule

    MAPPING = HFMapping(
        rules=(
            Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
            Rule(("model.layers.{layer}.self_attn.q_proj.weight",
                  "model.layers.{layer}.self_attn.k_proj.weight",
                  "model.layers.{layer}.self_attn.v_proj.weight"),
                 "decoder.layers.{layer}.self_attention.linear_qkv.weight", "fuse_qkv"),
            Rule(("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
                 "decoder.layers.{layer}.mlp.linear_fc1.weight", "fuse_gate_up"),
            Rule("lm_head.weight", "output_layer.weight", when="not tie_embeddings"),
        ),
        ranges={"layer": "num_layers"},                     # placeholder -> count (config attr)
        stacked=(("decoder.layers.{layer}.", "decoder.layers."),),  # megatron sharded-key folding
        ignore=(Ignore("model.layers.{layer}.self_attn.rotary_emb.inv_freq"),),
    )

    bound = MAPPING.bind(cfg)           # concrete Conversions for this config
    bound.check_hf(hf_names)            # MappingError naming missing / unknown tensors
    for name, tensor in bound.to_lf(get_hf_tensor): ...   # streaming; bound.to_hf likewise
    bound.location(name)                # -> Location(key, offsets, sizes) in a LoongForge checkpoint

- **Names.** LF names are megatron-core state-dict names with *global* indices, spelled as in
  megatron's sharded state dict (``linear_qkv.layer_norm_weight``, the name every layer spec
  saves under); a torch-engine family's are its module's ``state_dict`` names (LeRobot's Pi0.5
  table in loongforge-embodied). ``{name}`` placeholders are integer indices with ranges from the config; one
  on both sides of a rule makes one conversion per value, one on a single side is gathered
  into one conversion (index-major, then pattern order).
- **Transforms** (``transforms.py``): ``identity``, ``fuse_qkv`` (megatron's per-query-group
  interleaved q/k/v, weights and biases), ``fuse_gate_up`` (``linear_fc1 = [gate; up]``). A
  family with another layout subclasses ``Transform`` (``to_lf``/``to_hf``, exact inverses)
  and calls ``register_transform(name, instance)``.
- **Conditions.** ``when="attr"``, ``"not attr"`` or a callable on the config switch a rule,
  an ``Ignore``, a ``Tied`` or an ``Unused`` on and off (biases, tied embeddings).
- **HF tensors without an LF counterpart.** ``Ignore(hf)``: tolerated on import, never written.
  ``Tied(hf, of=...)``: a copy of the HF tensor ``of`` (a tied ``lm_head``), read in its place
  only when the checkpoint lacks ``of``, written as its copy. ``Unused(hf, shape=..., like=...)``:
  a tensor the model never uses, dropped on import, written as zeros of ``shape`` (sizes as in
  ``ranges``) in the dtype of the LF tensor ``like``. ``bound.sources(names)`` says which tensor
  of a checkpoint each conversion input is read from; ``bound.to_lf(get, names)`` uses it
  (``partial=True`` converts what is there, e.g. gradients of a subset of parameters).
- **Configless state dicts.** ``HFMapping.counts_in(names, side)`` reads each placeholder's
  range off a state dict's own names, for binding one that comes without its config.
- **Composition.** ``bound.prefixed(hf=..., lf=...)`` and ``+`` assemble a model from parts
  (a VLM's vision tower and language model), each bound to its own config.
- ``HFAdapter`` (``ModelSpec.hf_adapter``) adds the architectures a family reads and the
  ``config.json`` translation (architectures empty for an outside layout with no transformers
  architecture, e.g. LeRobot's, so ``hf_to_lf`` of a directory never picks it); ``convert``
  streams whole checkpoints between an HF directory and a LoongForge checkpoint of a megatron
  family (torch-engine families convert through their own CLI, with the same tables); ``online.HFPieceReader`` serves an HF directory to
  ``checkpoint.sharded.load_into`` as if it were a converted checkpoint (each rank reads its
  TP/PP/EP shards of the HF weights directly).
"""

from loongforge.core.hf_mapping.adapter import HFAdapter, family_for_architectures
from loongforge.core.hf_mapping.table import BoundMapping, Conversion, HFMapping, Ignore, Location, Rule, Tied, Unused
from loongforge.core.hf_mapping.transforms import (
    Concat,
    FuseQKV,
    Identity,
    MappingError,
    Transform,
    TransformContext,
    get_transform,
    register_transform,
)

__all__ = [
    "BoundMapping",
    "Concat",
    "Conversion",
    "FuseQKV",
    "HFAdapter",
    "HFMapping",
    "Identity",
    "Ignore",
    "Location",
    "MappingError",
    "Rule",
    "Tied",
    "Transform",
    "TransformContext",
    "Unused",
    "family_for_architectures",
    "get_transform",
    "register_transform",
]
