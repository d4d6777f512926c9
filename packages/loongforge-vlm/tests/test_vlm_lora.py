"""LoRA for ``lf-vlm`` against transformers + PEFT: a LoRA run from a tiny converted Qwen2.5-VL (and
InternVL), with
adapters chosen per part (the foundation's attention and MLP, the ViT's qkv and MLP output, the
merger's first linear), changes only the adapters; ``lf-vlm convert lora-to-peft`` loaded by
``peft.PeftModel.from_pretrained`` onto the transformers model the run started from gives, for an
image + text input, the logits of the merged export (``train --save-hf``, the same files as
``convert lf-to-hf`` of the LoRA checkpoint)."""

import json

import pytest
import torch

from loongforge.core.checkpoint import Checkpoint

RANK, ALPHA = 4, 8.0
TARGETS = "[foundation.linear_qkv,foundation.linear_proj,foundation.linear_fc1,foundation.linear_fc2," \
          "encoder.linear_qkv,encoder.linear_fc2,projector.linear_fc1]"


def tiny_qwen2_5_vl(ids):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, window_size=32,
                  out_hidden_size=64, fullatt_block_indexes=[1], tokens_per_second=2)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids.image, video_token_id=ids.video,
        vision_start_token_id=ids.start, vision_end_token_id=ids.end))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every weight random, norms around 1
            p.copy_((1.0 if "norm" in name or "ln_q" in name else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    return model


def tiny_internvl(ids):
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    from vlm_hf_cases import randomize_

    text = dict(model_type="qwen3", vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8, attention_bias=True)
    return randomize_(InternVLForConditionalGeneration(InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=ids.image, tie_word_embeddings=False)))


def tiny_qwen3_vl(ids):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from vlm_hf_cases import randomize_

    text = dict(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0])
    return randomize_(Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids.image, video_token_id=ids.video,
        vision_start_token_id=ids.start, vision_end_token_id=ids.end)))


def internvl_image_and_text(ids):
    """One sequence: text, one 32x32 tile (4 LLM tokens), text."""
    g = torch.Generator().manual_seed(1)
    tokens = (torch.randint(0, 1000, (5,), generator=g).tolist() + [ids.start] + [ids.image] * 4 + [ids.end]
              + torch.randint(0, 1000, (6,), generator=g).tolist())
    return dict(input_ids=torch.tensor([tokens]), pixel_values=torch.randn(1, 3, 32, 32, generator=g))


def image_and_text(ids):
    """One sequence: text, an image of 4x4 patches (4 LLM tokens), text."""
    g = torch.Generator().manual_seed(1)
    tokens = (torch.randint(0, 1000, (5,), generator=g).tolist() + [ids.start] + [ids.image] * 4 + [ids.end]
              + torch.randint(0, 1000, (6,), generator=g).tolist())
    return dict(input_ids=torch.tensor([tokens]), pixel_values=torch.randn(16, 3 * 2 * 8 * 8, generator=g),
                image_grid_thw=torch.tensor([[1, 4, 4]]))


def qwen3_image_and_text(ids):
    """``image_and_text`` plus the token types Qwen3-VL's multimodal RoPE reads (1: image)."""
    inputs = image_and_text(ids)
    return {**inputs, "mm_token_type_ids": (inputs["input_ids"] == ids.image).int()}


# model, its placeholders, LoRA targets, inputs, the encoder's layers left out, modules PEFT must adapt
CASES = {
    "qwen2_5_vl": (tiny_qwen2_5_vl, "qwen", TARGETS, image_and_text, "linear_fc1",
                   {"base_model.model.model.visual.blocks.0.attn.qkv", "base_model.model.model.visual.merger.mlp.0",
                    "base_model.model.model.language_model.layers.1.self_attn.v_proj"}),
    # Qwen3-VL's checkpoint names are already transformers' module names
    "qwen3_vl": (tiny_qwen3_vl, "qwen", TARGETS, qwen3_image_and_text, "linear_fc1",
                 {"base_model.model.model.visual.blocks.0.attn.qkv",
                  "base_model.model.model.language_model.layers.1.self_attn.v_proj"}),
    # InternViT's linear_fc2 is layer-scaled (refused as a target): its MLP input instead
    "internvl": (tiny_internvl, "internvl", TARGETS.replace("encoder.linear_fc2", "encoder.linear_fc1"),
                 internvl_image_and_text, "linear_fc2",
                 {"base_model.model.model.vision_tower.encoder.layer.0.attention.k_proj",
                  "base_model.model.model.vision_tower.encoder.layer.1.mlp.fc1",
                  "base_model.model.model.multi_modal_projector.linear_1",
                  "base_model.model.model.language_model.layers.1.self_attn.v_proj"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CASES))
def test_lora_per_part_trains_adapters_and_peft_matches_merged(kind, tmp_path, vlm_cache):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    from loongforge.vlm.cli import main
    from loongforge.vlm.data.tokenizer import load_vlm_tokenizer

    build, placeholders, targets, make_inputs, untargeted, adapted = CASES[kind]
    _, ids = load_vlm_tokenizer(placeholders=placeholders)
    hf = build(ids)
    hf.save_pretrained(tmp_path / "hf")
    model_class = type(hf)
    base = tmp_path / "lf"
    assert main(["convert", "hf-to-lf", str(tmp_path / "hf"), str(base), "--no-progress"]) == 0
    run = tmp_path / "run"
    assert main(["train", "--config", str(base / "train.yaml"), "checkpoint.load=null", f"lora.base={base}",
                 f"lora.rank={RANK}", f"lora.alpha={ALPHA}", f"lora.target_modules={targets}", "train.steps=2",
                 "train.global_batch_size=4", "train.warmup_steps=0", "train.lr=0.01", "train.seq_length=512",
                 "log.progress=false", "log.tensorboard=false", f"data.cache_dir={vlm_cache}", f"log.run_dir={run}",
                 "--save-hf", str(tmp_path / "merged")]) == 0

    # only the adapters changed, and each targeted part has them
    trained, start = Checkpoint(run / "checkpoints"), Checkpoint(base)
    keys = {k for k in trained.reader.keys() if not k.startswith("optimizer.")}
    adapters = {k for k in keys if k.endswith((".lora_A", ".lora_B"))}
    assert keys - adapters == set(start.reader.keys())
    for key in keys - adapters:
        assert torch.equal(trained.tensor(key), start.tensor(key)), key
    assert {k.split(".")[0] for k in adapters} == {"encoder", "projector", "language_model"}
    assert not any(untargeted in k for k in adapters if k.startswith("encoder."))  # the encoder's targets only
    assert all(trained.tensor(k).abs().max() > 0 for k in adapters if k.endswith(".lora_B"))

    peft_dir = tmp_path / "adapter"
    assert main(["convert", "lora-to-peft", str(run), str(peft_dir)]) == 0
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert main(["convert", "lf-to-hf", str(run / "checkpoints"), str(tmp_path / "exported"), "--no-progress"]) == 0

    inputs = make_inputs(ids)
    with torch.no_grad():
        original = model_class.from_pretrained(tmp_path / "hf").eval()
        base_logits = original(**inputs).logits
        with_adapter = PeftModel.from_pretrained(original, str(peft_dir)).eval()
        peft_logits = with_adapter(**inputs).logits
    # PEFT adapted exactly the exported layers: every part's, under the model's module names
    exported = {k.removesuffix(".lora_A.weight") for k in load_file(peft_dir / "adapter_model.safetensors")
                if k.endswith(".lora_A.weight")}
    assert {n for n, m in with_adapter.named_modules() if isinstance(m, LoraLayer)} == exported
    assert adapted <= exported
    with torch.no_grad():
        merged = [model_class.from_pretrained(tmp_path / d).eval()(**inputs).logits
                  for d in ("merged", "exported")]
    assert torch.equal(merged[0], merged[1])  # train --save-hf and convert lf-to-hf: the same merged model
    assert (merged[0] - base_logits).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(peft_logits, merged[0], rtol=0, atol=1e-5)


def test_lora_targets_name_parts(capsys):
    from loongforge.vlm.cli import main
    from loongforge.vlm.lora import model_targets

    assert model_targets(["foundation.linear_qkv", "encoder.self_attention.linear_proj", "linear_fc2", "re:x.*"]) == [
        r"re:language_model\.(.*\.)?linear_qkv", r"re:encoder\.(.*\.)?self_attention\.linear_proj", "linear_fc2",
        "re:x.*"]
    assert main(["train", "lora.rank=-2"]) == 2
    assert "lora.rank=-2" in capsys.readouterr().err



def test_adapters_train_in_the_trainable_parts_only(megatron_world):
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.config import ConfigError
    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.recipe import VLMTask

    def build(*overrides):
        task = VLMTask(load_vlm_config("vlm_debug", ["lora.rank=2", *overrides]))
        tc = TransformerConfig(**task.transformer_config_kwargs(), use_cpu_initialization=True)
        return task.build_model(megatron_world, tc, True, True)

    model = build("lora.target_modules=[linear_qkv,projector.linear_fc2]", "trainable=[foundation,projector]")
    adapters = {n for n, _ in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    # a plain entry adapts the layer in every part, a part-prefixed one in its part only
    assert {n.split(".")[0] for n in adapters} == {"encoder", "projector", "language_model"}
    assert not any("linear_fc1" in n for n in adapters)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in adapters if not n.startswith("encoder.")}  # the encoder is not trainable
    with pytest.raises(ConfigError, match=r"adapt no layer of the trainable parts \(trainable=\['foundation'\]\)"):
        build("lora.target_modules=[encoder.linear_qkv]", "trainable=[foundation]")
    with pytest.raises(ConfigError, match=r"lora.target_modules=\['foundation.q_proj'\]: .* match no linear layer"):
        build("lora.target_modules=[foundation.q_proj]")


def test_peft_export_refuses_a_composition_transformers_cannot_express():
    from loongforge.core.config import to_dict
    from loongforge.core.hf_mapping import MappingError
    from loongforge.vlm.cli import load_vlm_config
    from loongforge.vlm.lora import lora_layouts

    cfg = load_vlm_config("vlm_debug", ["encoder=siglip_vit_debug", "projector=mlp_2x"])
    with pytest.raises(MappingError, match="encoder.family='siglip_vit'"):
        lora_layouts({"family": "vlm", "model_config": to_dict(cfg.model())}, [])
