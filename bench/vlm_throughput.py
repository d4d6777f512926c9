"""VLM training-step throughput: lf-vlm's model and trainer step vs transformers' Qwen2.5-VL.

Run on a CUDA machine:  uv run python bench/vlm_throughput.py [--samples N] [--image-size PX] [--text-tokens T]
Smoke run on CPU:       LOONGFORGE_ACCELERATOR=cpu uv run python bench/vlm_throughput.py --tiny

The same as ``lf-vlm bench`` (``loongforge/vlm/bench.py`` says what runs): by default the real
Qwen2.5-VL vision transformer, its merger and the Qwen2.5-0.5B foundation, 8 samples of one
448px image between 768 text tokens, against ``Qwen2_5_VLForConditionalGeneration`` set up as
transformers recommends for GPU training (FlashAttention-2 where flash-attn is installed, else SDPA;
under ``torch.compile``; fused AdamW, TF32), on the same weights in the same process, in
alternating rounds (``--rounds``), with the first-step losses checked. Where the baseline's step
time varies from process to process, ``--processes N`` repeats it all in N fresh processes.
"""

from __future__ import annotations

import sys

from loongforge.vlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
