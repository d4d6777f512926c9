"""Tiny transformers models saved as HF directories, and their loss on the trainer's first batch."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2(tokenizer_dir, path):
    """A 2-layer Qwen2 (biases, tied embeddings) with random weights, saved to ``path`` with the
    tokenizer files of ``tokenizer_dir``; returned in eval mode."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=1280, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                         attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return model.eval()


def tiny_qwen3_5(tokenizer_dir, path):
    """A 4-layer Qwen3.5 (three Gated DeltaNet layers of 2 key / 4 value heads, then gated attention;
    untied embeddings) with random weights (the DeltaNet's decay parameters in their working range),
    saved to ``path`` with the tokenizer files of ``tokenizer_dir``; returned in eval mode."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=1280, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith(("A_log", "dt_bias")) else 0.1
            p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + scale * torch.randn_like(p))
    model.save_pretrained(path)
    for f in tokenizer_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return model.eval()


def first_batch_loss(model, cache_dir, seq: int, batch: int, steps: int) -> float:
    """transformers' loss on step 1's global batch, reduced like the trainer (per token)."""
    from loongforge.llm.data.shipped import bundled_dataset

    data = bundled_dataset(cache_dir, seq_length=seq, num_samples=steps * batch, seed=1234)
    samples = [data[i] for i in range(batch)]
    tokens, labels, mask, pos = (torch.stack([torch.as_tensor(s[k]) for s in samples])
                                 for k in ("tokens", "labels", "loss_mask", "position_ids"))
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=pos).logits
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return float((per_token * mask.flatten().float()).sum() / mask.sum())
