"""LoRA in one process: only the adapters train; the merged export is W + (alpha/r) B A and
computes what the adapted model computes; ``lora.base`` starts the adapters from a checkpoint's
weights. (The adapters alone, in PEFT's format: tests/test_llm_lora_peft.py.)"""

import pytest
import torch

from loongforge.core.checkpoint import Checkpoint
from loongforge.core.config import to_dict
from loongforge.llm.lora import LoRALinear, apply_lora, is_adapter, merge_checkpoint
from loongforge.llm.recipe import LLMTask, load_llm_config

RANK, ALPHA = 4, 8.0


def trainer(ctx, config: str, run_dir, data_cache, extra=()):
    from loongforge.core.training.loop import Trainer

    cfg = load_llm_config(config, ["train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2",
                                   "train.seq_length=32", "train.warmup_steps=0", "train.lr=0.01",
                                   f"log.run_dir={run_dir}", "log.progress=false", "log.tensorboard=false",
                                   f"data.cache_dir={data_cache}", "checkpoint.resume=false", *extra])
    return Trainer(LLMTask(cfg), ctx, cfg, config_record=to_dict(cfg))


def logits(tr, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4096, (2, 16), generator=g)
    tr.model.eval()
    with torch.no_grad():
        return tr.model(tokens, torch.arange(16).expand(2, 16), None)


def layer0_proj(ckpt: Checkpoint) -> torch.Tensor:
    """Layer 0's attention output projection in a checkpoint (per-layer or layer-stacked keys)."""
    keys = ckpt.reader.keys()
    if "decoder.layers.0.self_attention.linear_proj.weight" in keys:
        return ckpt.tensor("decoder.layers.0.self_attention.linear_proj.weight")
    return ckpt.tensor("decoder.layers.self_attention.linear_proj.weight")[0]


@pytest.mark.parametrize("config", ["train_debug", "train_qwen3_moe_debug"], ids=["llama", "qwen3_moe"])
def test_adapters_train_alone_and_export(config, megatron_world, tmp_path):
    lora = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}"]
    tr = trainer(megatron_world, config, tmp_path / "run", tmp_path / "cache", lora)
    model = tr.model.module
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapters = {n for n in before if is_adapter(n)}
    assert adapters and all(not p.requires_grad for n, p in model.named_parameters() if n not in adapters)
    if config == "train_qwen3_moe_debug":
        assert any(".experts." in n for n in adapters)  # the default targets reach the routed experts
    tr.fit()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == adapters
    adapted_logits = logits(tr)

    proj = model.decoder.layers[0].self_attention.linear_proj
    assert isinstance(proj, LoRALinear)
    expected = proj.weight.detach() + (ALPHA / RANK) * proj.lora_B.detach() @ proj.lora_A.detach()
    merged = Checkpoint(merge_checkpoint(tmp_path / "run" / "checkpoints", tmp_path / "merged"))
    torch.testing.assert_close(layer0_proj(merged), expected, atol=1e-6, rtol=0)
    assert not any(is_adapter(k) or k.startswith("optimizer.") for k in merged.reader.keys())

    plain = trainer(megatron_world, config, tmp_path / "plain", tmp_path / "cache", [f"checkpoint.load={tmp_path / 'merged'}"])
    from loongforge.core.training import checkpointing

    checkpointing.load_weights(plain, plain.ckpt_cfg.load)
    torch.testing.assert_close(logits(plain), adapted_logits, atol=1e-5, rtol=0)

    # new adapters (B = 0) on the merged weights compute the merged model
    again = trainer(megatron_world, config, tmp_path / "again", tmp_path / "cache", [*lora, f"lora.base={tmp_path / 'merged'}"])
    torch.testing.assert_close(logits(again), adapted_logits, atol=1e-5, rtol=0)


def test_targets_that_match_nothing_are_named(megatron_world, tmp_path):
    from loongforge.llm.lora import LoRAConfig

    tr = trainer(megatron_world, "train_debug", tmp_path / "run", tmp_path / "cache")
    with pytest.raises(ValueError, match=r"lora.target_modules=\['q_proj'\] match no linear layer; the model's are "
                                         r"\['linear_fc1', 'linear_fc2', 'linear_proj', 'linear_qkv', 'output_layer'\]"):
        apply_lora(tr.model.module, LoRAConfig(rank=2, target_modules=["q_proj"]))
    with pytest.raises(Exception, match="lora.rank=-1"):
        load_llm_config("train_debug", ["lora.rank=-1"])
