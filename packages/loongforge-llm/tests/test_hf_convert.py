"""HF import/export of the Llama, Qwen2.5 and Qwen3 families against transformers.

Tiny random transformers models (2 layers, hidden 64, GQA 4/2) are saved with
``save_pretrained``; converting them gives a megatron model whose logits equal transformers'
(fp32, atol 1e-5), exporting a trained-format checkpoint gives a directory transformers loads
with the same logits, and HF -> LoongForge -> HF is bitwise for every tensor.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from loongforge.core.hf_mapping import MappingError
from loongforge.core.hf_mapping.convert import hf_to_lf, lf_to_hf

VOCAB = 256
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True, "rms_norm_eps": 1e-6}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # head dim 32 != hidden / heads = 16
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight random (norm weights around 1, biases too), so each mapping shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=g))


def tiny_hf(family: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    model = model_cls(config_cls(**SHAPE, **extra, attn_implementation="eager"))
    randomize(model, seed)
    return model.eval()


def save_hf(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def ctx():
    from loongforge.core.parallel import destroy_parallel, init_parallel

    ctx = init_parallel()
    yield ctx
    destroy_parallel()


def our_trainer(ctx, model_config, run_dir: Path, **train):
    """The trainer's model (world of one, gloo) for ``model_config``; ``train``: SequenceTrainConfig overrides."""
    from loongforge.core.training.schema import LogConfig, SequenceTrainConfig
    from loongforge.core.training.loop import Trainer
    from loongforge.llm.recipe import LLMConfig, LLMTask

    train = SequenceTrainConfig(**{"steps": 1, "warmup_steps": 0, "global_batch_size": 1, "micro_batch_size": 1, **train})
    cfg = LLMConfig(model=model_config, train=train, log=LogConfig(run_dir=str(run_dir), tensorboard=False, progress=False))
    return Trainer(LLMTask(cfg), ctx, cfg)


def from_pretrained_logits(hf_dir: Path, tokens, pos) -> tuple[str, torch.Tensor]:
    """``(class name, logits)`` of ``AutoModelForCausalLM.from_pretrained(hf_dir)``, in this process
    (where ``init_parallel`` has installed the cpu accelerator's megatron adaptations)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return type(model).__name__, model(input_ids=tokens, position_ids=pos).logits


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=g)
    return tokens, torch.arange(24).expand(2, 24)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_to_lf_logits_match_transformers(family, ctx, tmp_path):
    from loongforge.core.training import checkpointing

    hf = tiny_hf(family)
    hf_dir = save_hf(hf, tmp_path / "hf", max_shard_size="100KB")  # sharded, with an index
    assert (hf_dir / "model.safetensors.index.json").is_file()
    done = hf_to_lf(hf_dir, tmp_path / "lf", progress=False, max_shard_bytes=200_000)
    assert done.family == family and done.path == tmp_path / "lf" / "step_00000000"
    assert len(list(done.path.glob("part-*.safetensors"))) > 1
    trainer = our_trainer(ctx, done.model_config, tmp_path / "run")
    checkpointing.load_weights(trainer, tmp_path / "lf")  # the weights-only load path of `checkpoint.load=`
    tokens, pos = batch()
    with torch.no_grad():
        ours = trainer.model(tokens, pos, None)
        ref = hf(input_ids=tokens, position_ids=pos).logits
    assert ref.std() > 0.1
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_bf16_weights_load_reaches_the_optimizer_main_params(ctx, tmp_path):
    """bf16 training keeps fp32 main params in the optimizer; ``checkpoint.load=`` must refresh them
    from the loaded weights, or the first step writes the random initial weights back. With lr=0 a
    step leaves the loaded weights as they are."""
    from loongforge.core.training import checkpointing

    hf_dir = save_hf(tiny_hf("llama"), tmp_path / "hf")
    done = hf_to_lf(hf_dir, tmp_path / "lf", progress=False)
    trainer = our_trainer(ctx, done.model_config, tmp_path / "run", precision="bf16", lr=0.0, min_lr_ratio=0.0)
    checkpointing.load_weights(trainer, tmp_path / "lf")
    loaded = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    tokens, pos = batch()
    trainer.train_step([{"tokens": tokens[:1], "labels": tokens[:1], "position_ids": pos[:1],
                         "loss_mask": torch.ones_like(tokens[:1], dtype=torch.float32)}])
    after = trainer.model.state_dict()
    assert any(v.dtype == torch.bfloat16 for v in loaded.values())
    changed = [k for k, v in loaded.items() if not torch.equal(v, after[k])]
    assert not changed, changed


@pytest.fixture(scope="module")
def exported(ctx, tmp_path_factory):
    """Per family: a trainer's randomly initialised model saved as training saves it (model +
    optimizer), exported to HF; our logits and transformers' from the exported directory."""
    from loongforge.core.models import get_model_spec
    from loongforge.core.training import checkpointing

    work = tmp_path_factory.mktemp("export")
    tokens, pos = batch(seed=2)
    out = {}
    for family in sorted(FAMILIES):
        model_config = get_model_spec(family).hf_adapter.config_from_hf(tiny_hf(family).config.to_dict())
        trainer = our_trainer(ctx, model_config, work / family / "run")
        randomize(trainer.model, seed=7)
        root = checkpointing.save(trainer, work / family / "ckpt").parent
        hf_dir = lf_to_hf(root, work / family / "hf", progress=False).path
        with torch.no_grad():
            ours = trainer.model(tokens, pos, None)
        out[family] = (ours, *from_pretrained_logits(hf_dir, tokens, pos), hf_dir)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trained_checkpoint_exports_to_transformers(family, exported):
    ours, arch, ref, out = exported[family]
    assert arch == FAMILIES[family][1].__name__
    assert (out / "tokenizer.json").is_file()  # the training tokenizer travels with the export
    assert ref.std() > 0.1
    torch.testing.assert_close(ref, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_is_bitwise(family, dtype, tmp_path):
    src = save_hf(tiny_hf(family).to(dtype), tmp_path / "hf")
    hf_to_lf(src, tmp_path / "lf", progress=False)
    back = lf_to_hf(tmp_path / "lf", tmp_path / "back", progress=False, max_shard_bytes=150_000).path
    assert (back / "model.safetensors.index.json").is_file()  # several output shards
    a, b = tensors_of(src), tensors_of(back)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype == dtype and torch.equal(a[name], b[name]), name
    with safe_open(str(next(back.glob("*.safetensors"))), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    cfg_a, cfg_b = (json.loads((d / "config.json").read_text()) for d in (src, back))
    for key in ("architectures", "hidden_size", "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters",
                "rms_norm_eps", "intermediate_size", "vocab_size", "dtype"):
        assert cfg_a.get(key) == cfg_b.get(key), key


def test_tokenizer_is_copied_and_referenced(tmp_path):
    from loongforge.llm.data.shipped import bundled_tokenizer_path

    src = save_hf(tiny_hf("qwen2"), tmp_path / "hf")
    for f in bundled_tokenizer_path().iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    done = hf_to_lf(src, tmp_path / "lf", progress=False)
    manifest = json.loads((done.path / "manifest.json").read_text())
    assert manifest["tokenizer"] == str(done.path / "tokenizer")
    assert "tokenizer/tokenizer.json" in manifest["files"]  # hashed like the weights
    back = lf_to_hf(tmp_path / "lf", tmp_path / "back", progress=False).path
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def drop_tensor(hf_dir: Path, name: str) -> None:
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})


def test_bad_hf_dirs_name_the_problem(tmp_path):
    src = save_hf(tiny_hf("llama"), tmp_path / "hf")

    drop_tensor(src, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(MappingError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"):
        hf_to_lf(src, tmp_path / "a", progress=False)

    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["MysteryForCausalLM"]}))
    with pytest.raises(MappingError, match=r"\['MysteryForCausalLM'\] are not supported.*supported: .*LlamaForCausalLM.*"
                                           r"Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        hf_to_lf(src, tmp_path / "b", progress=False)

    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    (src / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(MappingError, match="rope_parameters=.*llama3.*only the default RoPE"):
        hf_to_lf(src, tmp_path / "c", progress=False)

    (src / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(MappingError, match="attention_bias=True is not supported"):
        hf_to_lf(src, tmp_path / "d", progress=False)

    (src / "config.json").unlink()
    with pytest.raises(MappingError, match=r"config\.json: missing"):
        hf_to_lf(src, tmp_path / "e", progress=False)


def test_sliding_window_mistral_is_refused_by_key(tmp_path):
    """Mistral 7B v0.1/v0.2 attend within 4096-token windows, which the family does not implement."""
    config_cls, model_cls, _ = FAMILIES["mistral"]
    src = save_hf(model_cls(config_cls(**SHAPE, sliding_window=4096)), tmp_path / "hf")
    with pytest.raises(MappingError, match="sliding_window=4096 is not supported by LoongForge's mistral family"):
        hf_to_lf(src, tmp_path / "lf", progress=False)


def test_leftover_hf_tensor_is_an_error(tmp_path):
    src = save_hf(tiny_hf("qwen3"), tmp_path / "hf")
    tensors = load_file(src / "model.safetensors") | {"model.layers.0.mlp.extra_proj.weight": torch.ones(2, 2)}
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MappingError, match=r"1 tensor\(s\) the mapping does not know: model\.layers\.0\.mlp\.extra_proj\.weight"):
        hf_to_lf(src, tmp_path / "lf", progress=False)


def test_export_refuses_existing_output_and_foreign_tensors(tmp_path):
    src = save_hf(tiny_hf("qwen2"), tmp_path / "hf")
    done = hf_to_lf(src, tmp_path / "lf", progress=False)
    with pytest.raises(FileExistsError, match="already exists"):
        lf_to_hf(tmp_path / "lf", src, progress=False)
    manifest = json.loads((done.path / "manifest.json").read_text())
    manifest["model_config"]["num_layers"] = 3
    (done.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(MappingError, match=r"decoder\.layers\..*has leading shape \[2\], the model config implies \[3\]"):
        lf_to_hf(tmp_path / "lf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # nothing published on failure


def test_hf_dir_loads_straight_into_megatron(ctx, tmp_path):
    """The online path: megatron's sharded state dict read from the HF directory itself."""
    from loongforge.core.checkpoint import Checkpoint
    from loongforge.core.checkpoint.sharded import load_into
    from loongforge.core.hf_mapping.online import HFPieceReader
    from loongforge.core.models import get_model_spec

    hf = tiny_hf("qwen3", seed=3)
    src = save_hf(hf, tmp_path / "hf")
    adapter = get_model_spec("qwen3").hf_adapter
    model_config = adapter.config_from_hf(json.loads((src / "config.json").read_text()))
    reader = HFPieceReader(src, adapter.bind(model_config))
    offline = Checkpoint(hf_to_lf(src, tmp_path / "lf", progress=False).path).reader
    assert sorted(reader.keys()) == sorted(offline.keys())
    for key, offset, shape in [("decoder.layers.self_attention.linear_qkv.weight", (1, 40, 3), (1, 50, 20)),
                               ("decoder.layers.mlp.linear_fc1.weight", (0, 100, 0), (2, 60, 64)),
                               ("embedding.word_embeddings.weight", (10, 0), (5, 64))]:
        assert reader.global_shape(key) == offline.global_shape(key)
        assert torch.equal(reader.read(key, offset, shape), offline.read(key, offset, shape)), key

    trainer = our_trainer(ctx, model_config, tmp_path / "run")
    module = trainer.model.module
    module.load_state_dict(load_into(module.sharded_state_dict(), reader, {}, {}), strict=True)
    tokens, pos = batch()
    with torch.no_grad():
        ours = trainer.model(tokens, pos, None)
        ref = hf(input_ids=tokens, position_ids=pos).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
