"""HF import/export of the Qwen3-MoE and DeepSeek-V3 families against transformers.

Tiny random ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` models (fp32, every weight and
the routing correction bias random) are saved with ``save_pretrained`` (hub layout: one tensor
per expert projection) and converted with ``hf_to_lf``; the megatron model loading that
checkpoint gives transformers' logits and routes every token to the same experts in every MoE
layer. HF -> LoongForge -> HF is bitwise, and transformers loads the exported directory.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from loongforge.core.hf_mapping import MappingError
from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6, attn_implementation="eager")
QWEN3_MOE = dict(num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
DEEPSEEK_V3 = dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                   topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_MOE),
    "qwen3_moe-dense0": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {**QWEN3_MOE, "mlp_only_layers": [0]}),
    "deepseek_v3-yarn": (DeepseekV3Config, DeepseekV3ForCausalLM, {**DEEPSEEK_V3, "rope_parameters": YARN}),
    "deepseek_v3-rope": (DeepseekV3Config, DeepseekV3ForCausalLM, {**DEEPSEEK_V3, "first_k_dense_replace": 0,
                                                                   "n_group": 1, "n_shared_experts": 2}),
}


def tiny_hf(case: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = CASES[case]
    model = model_cls(config_cls(**COMMON, **extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif p.is_floating_point() and "inv_freq" not in name:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def ctx():
    from loongforge.core.parallel import destroy_parallel, init_parallel

    ctx = init_parallel()
    yield ctx
    destroy_parallel()


def our_trainer(ctx, model_config, run_dir: Path):
    from loongforge.core.training.schema import LogConfig, SequenceTrainConfig
    from loongforge.core.training.loop import Trainer
    from loongforge.llm.recipe import LLMConfig, LLMTask

    cfg = LLMConfig(model=model_config, train=SequenceTrainConfig(steps=1, warmup_steps=0, global_batch_size=1, micro_batch_size=1),
                    log=LogConfig(run_dir=str(run_dir), tensorboard=False, progress=False))
    return Trainer(LLMTask(cfg), ctx, cfg)


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 24), generator=g), torch.arange(24).expand(2, 24)


def hf_routing(hf, tokens, pos) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' logits and, per MoE layer, the ``[batch*seq, experts]`` routing map."""
    maps, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            def record(module, args, out, i=i):
                indices = out[2]
                maps[i] = torch.zeros(indices.shape[0], module.weight.shape[0], dtype=torch.bool).scatter(1, indices, True)
            hooks.append(gate.register_forward_hook(record))
    with torch.no_grad():
        logits = hf(input_ids=tokens, position_ids=pos).logits
    for h in hooks:
        h.remove()
    return logits, maps


def our_routing(model, tokens, pos) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Our logits and, per MoE layer, megatron's routing map in transformers' token order
    (megatron routes ``[seq, batch]``-major tokens)."""
    core = model.module
    maps, hooks = {}, []
    b, s = tokens.shape
    for i, layer in enumerate(core.decoder.layers):
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            def record(module, args, out, i=i):
                maps[i] = out[1].view(s, b, -1).transpose(0, 1).reshape(b * s, -1).bool()
            hooks.append(router.register_forward_hook(record))
    with torch.no_grad():
        logits = model(tokens, pos, None)
    for h in hooks:
        h.remove()
    return logits, maps


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_lf_logits_and_routing_match_transformers(case, ctx, tmp_path):
    from loongforge.core.training import checkpointing

    hf = tiny_hf(case)
    hf.save_pretrained(tmp_path / "hf")
    done = hf_to_lf(tmp_path / "hf", tmp_path / "lf", progress=False)
    assert done.family == case.split("-")[0]
    trainer = our_trainer(ctx, done.model_config, tmp_path / "run")
    checkpointing.load_weights(trainer, tmp_path / "lf")
    trainer.model.eval()
    tokens, pos = batch()
    ref, ref_maps = hf_routing(hf, tokens, pos)
    ours, our_maps = our_routing(trainer.model, tokens, pos)
    assert ref.std() > 0.1
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert sorted(our_maps) == sorted(ref_maps) and ref_maps
    for layer, ref_map in ref_maps.items():
        assert ref_map.sum(1).eq(hf.config.num_experts_per_tok).all()
        assert torch.equal(our_maps[layer], ref_map), f"layer {layer}: different experts selected"


EXPORTED_LOGITS = """
import sys, torch
from transformers import AutoModelForCausalLM
tokens, pos = torch.load(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], attn_implementation="eager").eval()
with torch.no_grad():
    torch.save((type(model).__name__, model(input_ids=tokens, position_ids=pos).logits), sys.argv[3])
"""


@pytest.mark.parametrize("case", ["qwen3_moe-dense0", "deepseek_v3-yarn"])
def test_round_trip_is_bitwise_and_transformers_loads_the_export(case, tmp_path):
    hf = tiny_hf(case, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_lf(tmp_path / "hf", tmp_path / "lf", progress=False)
    lf_to_hf(tmp_path / "lf", tmp_path / "back", progress=False)
    original, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert torch.equal(back[name], t), name
    tokens, pos = batch(seed=4)
    torch.save((tokens, pos), tmp_path / "inputs.pt")
    proc = subprocess.run([sys.executable, "-c", EXPORTED_LOGITS, str(tmp_path / "inputs.pt"), str(tmp_path / "back"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, logits = torch.load(tmp_path / "logits.pt")
    assert name == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(input_ids=tokens, position_ids=pos).logits, atol=1e-5, rtol=0)


def test_unsupported_hf_features_are_named(tmp_path):
    from loongforge.llm.families.moe_hf import deepseek_v3_from_hf, qwen3_moe_from_hf

    raw = DeepseekV3Config(**{k: v for k, v in COMMON.items() if k != "attn_implementation"},
                           **{**DEEPSEEK_V3, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 2}).to_dict()
    with pytest.raises(MappingError, match="top-2 scores"):
        deepseek_v3_from_hf(raw)
    with pytest.raises(MappingError, match="norm_topk_prob=False"):
        deepseek_v3_from_hf({**raw, "topk_group": 1, "norm_topk_prob": False})
    with pytest.raises(MappingError, match="q_lora_rank=None"):
        deepseek_v3_from_hf({**raw, "topk_group": 1, "q_lora_rank": None})
    raw = Qwen3MoeConfig(**{k: v for k, v in COMMON.items() if k != "attn_implementation"}, **QWEN3_MOE).to_dict()
    with pytest.raises(MappingError, match=r"mlp_only_layers=\[1\]"):
        qwen3_moe_from_hf({**raw, "mlp_only_layers": [1]})
    assert json.loads(json.dumps(qwen3_moe_from_hf(raw).__dict__))["num_experts"] == 4
