"""LLM training-step throughput: lf-llm's model and trainer step vs HF transformers' Llama.

Run on a CUDA machine:  uv run python bench/llm_throughput.py [--steps N] [--fp8 MODE] [--variant NAME=KEY=VALUE,...]

The same as ``lf-llm bench`` (``loongforge/llm/bench.py`` says what runs): by default the
``train_0_5b`` case, a ~0.5B Llama (8 layers, hidden 2048, 16 heads / 4 KV heads, FFN 5632, vocab
32000), batch 4 x 4096 tokens, bf16, AdamW, on one GPU, against ``LlamaForCausalLM`` set up as
transformers recommends for GPU training (FlashAttention-2 where flash-attn is installed, else SDPA;
``torch.compile``; fused AdamW; TF32), with and without Liger's kernels (where liger-kernel is
installed), from the same weights with the first-step losses checked, in alternating rounds;
MFU against the measured matmul and the device's spec peak.
"""

from __future__ import annotations

import sys

from loongforge.llm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
