"""The declarative HF mapping engine: layouts, expansion, errors, bitwise round trips."""

from dataclasses import dataclass

import pytest
import torch

from loongforge.core.hf_mapping import (
    HFMapping,
    Ignore,
    Location,
    MappingError,
    Rule,
    Tied,
    Transform,
    Unused,
    get_transform,
    register_transform,
)


@dataclass
class Cfg:
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 3
    hidden: int = 5
    num_experts: int = 3
    bias: bool = True
    tie: bool = False


ATTN = "model.layers.{layer}.attn."
TABLE = HFMapping(
    rules=(
        Rule("embed.weight", "embedding.word_embeddings.weight"),
        Rule((ATTN + "q.weight", ATTN + "k.weight", ATTN + "v.weight"), "decoder.layers.{layer}.qkv.weight", "fuse_qkv"),
        Rule((ATTN + "q.bias", ATTN + "k.bias", ATTN + "v.bias"), "decoder.layers.{layer}.qkv.bias", "fuse_qkv", when="bias"),
        Rule(("model.layers.{layer}.gate.weight", "model.layers.{layer}.up.weight"), "decoder.layers.{layer}.fc1.weight", "fuse_gate_up"),
        Rule("model.layers.{layer}.experts.{expert}.w", "decoder.layers.{layer}.experts.w{expert}"),
        Rule("lm_head.weight", "output_layer.weight", when="not tie"),
    ),
    ranges={"layer": "num_layers", "expert": "num_experts"},
    stacked=(("decoder.layers.{layer}.", "decoder.layers."), ("experts.w{expert}", "experts.w")),
    ignore=(Ignore("model.layers.{layer}.attn.rotary.inv_freq"), Ignore("lm_head.weight", when="tie")),
)


def hf_state(cfg: Cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, kv, h = cfg.num_attention_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim, cfg.hidden
    sd = {"embed.weight": torch.randn(11, h, generator=g)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd |= {p + "attn.q.weight": torch.randn(q, h, generator=g), p + "attn.k.weight": torch.randn(kv, h, generator=g),
               p + "attn.v.weight": torch.randn(kv, h, generator=g), p + "gate.weight": torch.randn(7, h, generator=g),
               p + "up.weight": torch.randn(7, h, generator=g)}
        if cfg.bias:
            sd |= {p + "attn.q.bias": torch.randn(q, generator=g), p + "attn.k.bias": torch.randn(kv, generator=g),
                   p + "attn.v.bias": torch.randn(kv, generator=g)}
        sd |= {f"{p}experts.{e}.w": torch.randn(2, h, generator=g) for e in range(cfg.num_experts)}
    if not cfg.tie:
        sd["lm_head.weight"] = torch.randn(11, h, generator=g)
    return sd


def reference_fused_qkv(q, k, v, heads, groups, d):
    """megatron's layout written out: per KV group, its query heads, its key head, its value head."""
    per = heads // groups
    rows = []
    for grp in range(groups):
        rows += [q[(grp * per + j) * d:(grp * per + j + 1) * d] for j in range(per)]
        rows += [k[grp * d:(grp + 1) * d], v[grp * d:(grp + 1) * d]]
    return torch.cat(rows)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_round_trip_is_bitwise(bias, tie):
    cfg = Cfg(bias=bias, tie=tie)
    hf = hf_state(cfg)
    bound = TABLE.bind(cfg)
    bound.check_hf(hf)
    lf = dict(bound.to_lf(hf.__getitem__))
    bound.check_lf(lf)
    assert ("decoder.layers.1.qkv.bias" in lf) == bias and ("output_layer.weight" in lf) == (not tie)
    back = dict(bound.to_hf(lf.__getitem__))
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_qkv_weight_and_bias_layout_matches_megatron():
    cfg = Cfg()
    hf = hf_state(cfg)
    lf = dict(TABLE.bind(cfg).to_lf(hf.__getitem__))
    for kind in ("weight", "bias"):
        q, k, v = (hf[f"model.layers.1.attn.{x}.{kind}"] for x in "qkv")
        expected = reference_fused_qkv(q, k, v, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim)
        assert torch.equal(lf[f"decoder.layers.1.qkv.{kind}"], expected)
    gate, up = hf["model.layers.0.gate.weight"], hf["model.layers.0.up.weight"]
    assert torch.equal(lf["decoder.layers.0.fc1.weight"], torch.cat([gate, up]))


def test_split_outputs_own_their_storage():
    cfg = Cfg(num_query_groups=1)  # one group: q is a contiguous prefix of the fused tensor
    hf = hf_state(cfg)
    bound = TABLE.bind(cfg)
    back = dict(bound.to_hf(dict(bound.to_lf(hf.__getitem__)).__getitem__))
    ptrs = [back[f"model.layers.0.attn.{x}.weight"].untyped_storage().data_ptr() for x in "qkv"]
    assert len(set(ptrs)) == 3


def test_locations_fold_layers_and_experts():
    bound = TABLE.bind(Cfg())
    assert bound.location("decoder.layers.1.qkv.weight") == Location("decoder.layers.qkv.weight", (1,), (2,))
    assert bound.location("decoder.layers.1.experts.w2") == Location("decoder.layers.experts.w", (1, 2), (2, 3))
    assert bound.location("embedding.word_embeddings.weight") == Location("embedding.word_embeddings.weight")


def test_gathered_placeholder_collects_all_indices_in_order():
    class Stack(Transform):
        n_lf = 1

        def to_lf(self, tensors, ctx):
            return [torch.stack(tensors)]

        def to_hf(self, tensors, ctx):
            return [t.clone() for t in tensors[0].unbind(0)]

    register_transform("test_stack_experts", Stack())
    table = HFMapping((Rule("l.{layer}.e.{expert}.w", "decoder.layers.{layer}.experts.w", "test_stack_experts"),),
                      ranges={"layer": "num_layers", "expert": "num_experts"})
    bound = table.bind(Cfg())
    assert bound.conversions[1].hf == ("l.1.e.0.w", "l.1.e.1.w", "l.1.e.2.w")
    hf = {f"l.{i}.e.{e}.w": torch.full((2,), float(10 * i + e)) for i in range(2) for e in range(3)}
    lf = dict(bound.to_lf(hf.__getitem__))
    assert lf["decoder.layers.1.experts.w"][:, 0].tolist() == [10.0, 11.0, 12.0]
    assert all(torch.equal(v, hf[k]) for k, v in bound.to_hf(lf.__getitem__))


def test_missing_and_unknown_tensors_are_named():
    cfg = Cfg()
    hf = hf_state(cfg)
    del hf["model.layers.1.attn.v.weight"]
    hf["model.layers.0.attn.rotary.inv_freq"] = torch.ones(2)  # ignored
    hf["model.layers.0.mystery.weight"] = torch.ones(2)
    with pytest.raises(MappingError, match=r"missing 1 tensor.*model\.layers\.1\.attn\.v\.weight.*"
                                           r"1 tensor\(s\) the mapping does not know: model\.layers\.0\.mystery\.weight"):
        TABLE.bind(cfg).check_hf(hf, source="ckpt-dir")


def test_tied_lm_head_may_be_present():
    cfg = Cfg(tie=True)
    hf = hf_state(cfg) | {"lm_head.weight": torch.ones(11, 5)}
    bound = TABLE.bind(cfg)
    bound.check_hf(hf)
    lf = dict(bound.to_lf(hf.__getitem__))
    assert "output_layer.weight" not in lf and "lm_head.weight" not in dict(bound.to_hf(lf.__getitem__))
    with pytest.raises(MappingError, match="does not know: output_layer.weight"):
        bound.check_lf({**lf, "output_layer.weight": hf["lm_head.weight"]})


def test_shape_errors_name_the_tensor():
    cfg = Cfg()
    hf = hf_state(cfg)
    hf["model.layers.0.attn.k.weight"] = torch.ones(4, 5)
    with pytest.raises(MappingError, match=r"model\.layers\.0\.attn\.k\.weight: shape \[4, 5\], expected 6 rows"):
        dict(TABLE.bind(cfg).to_lf(hf.__getitem__))


def test_prefixed_and_combined_parts():
    text = TABLE.bind(Cfg(num_layers=1))
    vision = HFMapping((Rule("blocks.{layer}.w", "decoder.layers.{layer}.w"),), ranges={"layer": "num_layers"},
                       stacked=(("decoder.layers.{layer}.", "decoder.layers."),)).bind(Cfg(num_layers=3))
    both = text.prefixed(hf="model.language_model.", lf="language_model.") + vision.prefixed(hf="model.visual.", lf="vision_model.")
    assert "model.visual.blocks.2.w" in both.hf_names
    assert both.location("vision_model.decoder.layers.2.w") == Location("vision_model.decoder.layers.w", (2,), (3,))
    assert both.is_ignored("model.language_model.model.layers.0.attn.rotary.inv_freq")
    with pytest.raises(MappingError, match="more than once"):
        _ = text + text


def test_hf_prefix_replaced_renames_only_matching_names():
    text = TABLE.bind(Cfg(num_layers=1))
    nested = text.hf_prefix_replaced("model.", "model.language_model.")
    renamed = {n for n in nested.hf_names if n.startswith("model.language_model.")}
    assert renamed == {"model.language_model." + n[len("model."):] for n in text.hf_names if n.startswith("model.")}
    assert [n for n in nested.hf_names if not n.startswith("model.")] == [n for n in text.hf_names if not n.startswith("model.")]
    assert nested.lf_names == text.lf_names
    assert nested.is_ignored("model.language_model.layers.0.attn.rotary.inv_freq")
    assert not nested.is_ignored("model.layers.0.attn.rotary.inv_freq")


def test_transform_registry_errors():
    with pytest.raises(MappingError, match="unknown transform 'nope'; registered: .*fuse_qkv"):
        get_transform("nope")
    with pytest.raises(MappingError, match="already registered"):
        register_transform("fuse_qkv", get_transform("identity"))
    with pytest.raises(MappingError, match=r"placeholder\(s\) \['head'\] have no range"):
        HFMapping((Rule("a.{head}", "b.{head}"),)).bind(Cfg())


# A table with a tied head (a copy of the embedding, read only when the embedding is absent) and
# a second head the model never uses (written as zeros of a config-derived shape on export).
HEADS = HFMapping(
    rules=(
        Rule("embed.weight", "embedding.weight"),
        Rule("layers.{layer}.w", "decoder.layers.{layer}.w"),
        Rule("proj.weight", "proj.weight"),
    ),
    ranges={"layer": "num_layers"},
    tied=(Tied("lm_head.weight", of="embed.weight", when="tie"),),
    unused=(Unused("expert_head.weight", shape=(11, "hidden"), like="proj.weight"),
            Unused("layers.{layer}.unused_bias", shape=(lambda c: c.hidden,), like="decoder.layers.{layer}.w")),
)


def heads_state(cfg: Cfg) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {"embed.weight": torch.randn(11, cfg.hidden, generator=g), "proj.weight": torch.randn(4, 4, generator=g).bfloat16()}
    return sd | {f"layers.{i}.w": torch.randn(cfg.hidden, generator=g) for i in range(cfg.num_layers)}


def test_tied_and_unused_tensors_round_trip():
    cfg = Cfg(tie=True)
    bound = HEADS.bind(cfg)
    hf = heads_state(cfg)
    exported = hf | {"lm_head.weight": hf["embed.weight"].clone(), "expert_head.weight": torch.zeros(11, cfg.hidden, dtype=torch.bfloat16)}
    exported |= {f"layers.{i}.unused_bias": torch.zeros(cfg.hidden) for i in range(cfg.num_layers)}
    bound.check_hf(exported)  # tied copies and unused tensors are known names
    lf = dict(bound.to_lf(exported.__getitem__, exported))
    assert sorted(lf) == sorted(["embedding.weight", "proj.weight"] + [f"decoder.layers.{i}.w" for i in range(2)])
    assert torch.equal(lf["embedding.weight"], hf["embed.weight"])
    back = dict(bound.to_hf(lf.__getitem__))
    assert sorted(back) == sorted(exported) == sorted(bound.export_names)
    for name, t in exported.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert back["lm_head.weight"].untyped_storage().data_ptr() != back["embed.weight"].untyped_storage().data_ptr()
    assert back["expert_head.weight"].dtype == torch.bfloat16  # the dtype of its `like` tensor
    bound.check_hf(hf)  # both heads may be absent on import


def test_tied_copy_stands_in_only_for_a_missing_original():
    cfg = Cfg(tie=True)
    bound = HEADS.bind(cfg)
    hf = heads_state(cfg)
    only_copy = {k: v for k, v in hf.items() if k != "embed.weight"} | {"lm_head.weight": torch.ones(11, cfg.hidden)}
    bound.check_hf(only_copy)
    assert bound.sources(only_copy)["embed.weight"] == "lm_head.weight"
    assert torch.equal(dict(bound.to_lf(only_copy.__getitem__, only_copy))["embedding.weight"], torch.ones(11, cfg.hidden))
    both = hf | {"lm_head.weight": torch.ones(11, cfg.hidden)}  # the original wins over its copy
    assert torch.equal(dict(bound.to_lf(both.__getitem__, both))["embedding.weight"], hf["embed.weight"])
    with pytest.raises(MappingError, match=r"missing 1 tensor.*: embed\.weight"):
        bound.check_hf({k: v for k, v in hf.items() if k != "embed.weight"})
    with pytest.raises(MappingError, match=r"embed\.weight.* missing \(no tied copy either\)"):
        dict(bound.to_lf(hf.__getitem__, [k for k in hf if k != "embed.weight"]))
    untied = HEADS.bind(Cfg(tie=False))  # the condition switches the tie off: the copy is unknown
    with pytest.raises(MappingError, match="does not know: lm_head.weight"):
        untied.check_hf(both)
    assert "lm_head.weight" not in dict(untied.to_hf(dict(untied.to_lf(hf.__getitem__)).__getitem__))


def test_partial_conversion_skips_what_is_absent():
    cfg = Cfg()
    bound = HEADS.bind(cfg)
    hf = heads_state(cfg)
    grads = {k: v for k, v in hf.items() if k != "layers.1.w"}
    bound.check_hf(grads, partial=True)
    with pytest.raises(MappingError, match="does not know: bogus"):
        bound.check_hf({**grads, "bogus": torch.ones(1)}, partial=True)
    assert sorted(dict(bound.to_lf(grads.__getitem__, grads, partial=True))) == ["decoder.layers.0.w", "embedding.weight", "proj.weight"]


def test_counts_in_reads_ranges_off_the_names():
    hf = heads_state(Cfg(num_layers=3))
    assert HEADS.counts_in(hf) == {"layer": 3}
    assert HEADS.counts_in(["decoder.layers.4.w"], side="lf") == {"layer": 5}
    assert HEADS.counts_in(["embed.weight"]) == {"layer": 0}
    assert TABLE.counts_in(hf_state(Cfg(num_layers=2, num_experts=4))) == {"layer": 2, "expert": 4}


def test_tied_and_unused_survive_prefix_and_composition():
    cfg = Cfg(tie=True)
    bound = HEADS.bind(cfg).prefixed(hf="model.", lf="policy.") + TABLE.bind(Cfg(num_layers=1))
    assert bound.tied == {"model.lm_head.weight": "model.embed.weight"}
    lf = {"policy.embedding.weight": torch.ones(11, 5), "policy.proj.weight": torch.ones(4, 4),
          **{f"policy.decoder.layers.{i}.w": torch.ones(5) for i in range(2)}}
    conv = next(c for c in bound.conversions if c.lf == ("policy.proj.weight",))
    assert [n for n, _ in bound.hf_outputs(conv, [lf["policy.proj.weight"]])] == ["model.proj.weight", "model.expert_head.weight"]


def test_tied_and_unused_errors_name_the_tensor():
    with pytest.raises(MappingError, match=r"tied tensor 'head' copies 'nope', which no rule maps"):
        HFMapping((Rule("a", "b"),), tied=(Tied("head", of="nope"),)).bind(Cfg())
    with pytest.raises(MappingError, match=r"unused tensor 'head' takes the dtype of 'nope', which no rule maps"):
        HFMapping((Rule("a", "b"),), unused=(Unused("head", shape=(1,), like="nope"),)).bind(Cfg())
    with pytest.raises(MappingError, match="more than once: a"):
        HFMapping((Rule("a", "b"),), unused=(Unused("a", shape=(1,), like="b"),)).bind(Cfg())
    with pytest.raises(MappingError, match="same placeholders"):
        Tied("h.{layer}", of="e")
    missing_size = HFMapping((Rule("a", "b"),), unused=(Unused("head", shape=("vocab",), like="b"),)).bind({"vocab": None})
    with pytest.raises(MappingError, match="gives no value for 'vocab'"):
        dict(missing_size.to_hf({"b": torch.ones(1)}.__getitem__))
