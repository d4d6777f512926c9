#!/usr/bin/env bash
# The VLM, diffusion and robot-policy benches on one CUDA machine (an H100 or H200), each within
# one device call (all three together take up to 11 minutes, over one call's 10: run them apart):
#
#   bash bench/modalities_batch.sh [vlm|diffusion|embodied]   (one of the three alone; all three without)
#
#   1. lf-vlm bench --case qwen2_5_vl_3b: Qwen2.5-VL-3B's shape in pure bf16 (4 samples x 2048 tokens,
#      images of four sizes), ours against transformers compiled (hf_compile);
#   2. lf-diffusion bench --config bench_wan2_1_t2v_1_3b: the whole Wan 2.1 T2V 1.3B (30 layers) on 81
#      frames of 480x832, ours against diffusers compiled (compile_repeated_blocks) at the same
#      gradient checkpointing (whole blocks);
#   3. lf-embodied bench model=pi05_dit_head_2b: a GR00T-style policy at a real size, ours' step time, samples/s
#      and MFU (model FLOPs counted by torch); not against LeRobot, whose wheels (and the LeRobot
#      dataset reader ours' data needs) do not travel in this call: without lerobot importable the
#      stage says so and is skipped.
#
# Each runs one round (--rounds 1) under a time limit of its own (PROFILE_ROWS=N adds ours' profile,
# N rows of top kernels and ops, about 30 s more a bench); each prints its baseline's settings,
# the first-step losses of both sides (checked), peak memory and the ratios. docs/benchmarks.md says
# what each case is and how to run it alone.
#
# The machine has torch 2.11, triton 3.6 and transformers but no PyPI and no diffusers: the missing
# wheels travel in .whl/ (carry it): megatron-core, omegaconf, hydra-core, antlr4-python3-runtime,
# psutil, diffusers (pure Python, ~4 MB), and LoongForge's own, from
# `uv build --wheel --package loongforge-<name> -o .whl` for core, llm, vlm, diffusion, embodied and
# kernels. Wheels in a carried .whl-*/ folder (e.g. lerobot and its imports) are installed too.
# Everything printed also goes to $OUT/modalities-<which>.log (modalities-all.log without an argument).
set -uo pipefail
only=${1:-all}
case $only in
  all|vlm|diffusion|embodied) ;;
  *) echo "usage: modalities_batch.sh [vlm|diffusion|embodied] (got '$only')"; exit 2 ;;
esac
OUT=${OUT:-/tmp/lf-modalities-bench}
LOG=modalities-$only.log
source "$(dirname "$0")/device_batch.sh"

section environment
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers, diffusers, megatron.core; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "diffusers", diffusers.__version__, "megatron-core", megatron.core.__version__)'

wanted() { [ "$only" = all ] || [ "$only" = "$1" ]; }
one_round="--rounds 1 --steps 5 --warmup 2 --profile-rows ${PROFILE_ROWS:-0}"
if wanted vlm; then
  bench 400 python3 -m loongforge.vlm.cli bench --case qwen2_5_vl_3b --skip hf_eager $one_round
fi
if wanted diffusion; then
  bench 210 python3 -m loongforge.diffusion.cli bench --config bench_wan2_1_t2v_1_3b $one_round
fi
if wanted embodied; then
  if python3 -c 'import lerobot' 2>/dev/null; then
    bench 240 python3 -m loongforge.embodied.cli bench model=pi05_dit_head_2b train.precision=bf16 --batch-size 8 $one_round
  else
    section "lf-embodied bench model=pi05_dit_head_2b: skipped (lerobot is not installed: ours' data is a LeRobot dataset)"
  fi
fi
