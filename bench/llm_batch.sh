#!/usr/bin/env bash
# The LLM step's benchmarks on one CUDA machine (H100 or H200), in stages that each fit one
# 10-minute device call:
#
#   bash bench/llm_batch.sh profile  # the loss head alone (ours vs Liger), torch._scaled_mm's blockwise FP8 scale
#                                    # layouts, then the 1B case in both precision recipes against hf_liger only,
#                                    # with ours' kernel profile
#   bash bench/llm_batch.sh cases-a  # the kernels' GPU tests; pure bf16: bench_llama_1b (with ours' profile) and
#                                    # train_0_5b against hf_compile and hf_liger; mixed: bench_llama_1b against
#                                    # hf_liger, with ours in FP8 (blockwise) beside ours in bf16
#   bash bench/llm_batch.sh cases-b  # mixed: train_0_5b against hf_liger; bench_qwen3_4b in pure bf16 (and mixed
#                                    # where it fits: an H200)
#   bash bench/llm_batch.sh short    # the kernels' GPU tests, then both cases in both recipes against hf_liger
#                                    # only (no compile), the 1B case with FP8 beside it, then bench_qwen3_4b
#                                    # in pure bf16: ~8 minutes
#   bash bench/llm_batch.sh pair     # the 1B case in both recipes against hf_liger: ~3 minutes
#   bash bench/llm_batch.sh pure     # the changed kernels' GPU tests; pure bf16 against hf_liger: the 1B case (with ours'
#                                    # profile and the GPU's idle gaps from its trace), bench_qwen3_4b, train_0_5b: ~8 minutes
#   bash bench/llm_batch.sh pure-short # the norm and embedding kernels' GPU tests; pure bf16 against hf_liger: the 1B
#                                    # case and train_0_5b, each with ours' profile: ~5 minutes
#   bash bench/llm_batch.sh fp8      # the FP8 kernels' GPU tests; pure bf16, the 1B case: ours in bf16 and FP8 blockwise
#                                    # against hf_liger, then ours in FP8 blockwise alone with its kernel
#                                    # profile (which GEMMs run on cuBLAS, what quantising costs): ~6 minutes
#   bash bench/llm_batch.sh host     # where the forward waits for the host: bench/host_overhead.py, then the 1B case
#                                    # in pure bf16 against hf_liger with ours' trace and its idle gaps: ~4 minutes
#   bash bench/llm_batch.sh shortest # the AdamW kernel's GPU test, the 1B case in both recipes against hf_liger
#                                    # (FP8 beside mixed), then train_0_5b in pure bf16: ~5 minutes
#
# Each bench prints the precision recipe both sides train with, the baseline's settings, the
# first-step losses, peak memory, MFU against the spec peak and the ratios; docs/benchmarks.md's
# LLM tables are copied from these logs.
#
# The machine has torch, triton and transformers but no PyPI: the missing wheels travel in .whl/
# (megatron-core, omegaconf, hydra-core, antlr4, liger-kernel, psutil, pytest and its plugins, and
# LoongForge's own wheels from `uv build --wheel --package loongforge-<name> -o .whl` for core, llm
# and kernels). Everything printed also goes to $OUT/<stage>.log.
set -uo pipefail
stage=${1:?usage: llm_batch.sh profile|cases-a|cases-b|short|shortest|pair|pure|pure-short|fp8|host}
OUT=${OUT:-/tmp/lf-llm-bench}
LOG=$stage.log
source "$(dirname "$0")/device_batch.sh"
llm_bench() { local limit=$1; shift; bench "$limit" python3 -m loongforge.llm.cli bench "$@"; }

section environment
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers, megatron.core, liger_kernel; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "megatron-core", megatron.core.__version__)'

case $stage in
profile)
  (cd "$repo" && timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_grouped_qkv_rope.py packages/loongforge-kernels/tests/test_linear_cross_entropy.py \
      packages/loongforge-kernels/tests/test_gpu_model_shapes.py -k "cross_entropy or qkv" 2>&1 | tail -n 5)
  bench 60 python3 "$repo/bench/linear_ce_bench.py"
  bench 60 python3 "$repo/bench/fp8_scaled_mm_probe.py"
  for precision in bf16-pure bf16; do
    llm_bench 170 --config bench_llama_1b --skip hf_compile --skip hf_eager --rounds 1 --profile-rows 45 \
        train.precision=$precision
  done
  ;;
cases-a)
  (cd "$repo" && timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_adamw.py packages/loongforge-kernels/tests/test_grouped_qkv_rope.py \
      packages/loongforge-kernels/tests/test_linear_cross_entropy.py 2>&1 | tail -n 3)
  llm_bench 200 --config bench_llama_1b --skip hf_eager --rounds 1 --profile-rows 30 \
      --variant adamw=train.optimizer_kernel=loongforge train.precision=bf16-pure
  llm_bench 140 --config train_0_5b --skip hf_eager --rounds 1 --profile-rows 0 train.precision=bf16-pure
  llm_bench 170 --config bench_llama_1b --skip hf_eager --skip hf_compile --rounds 1 --profile-rows 0 \
      --fp8 blockwise train.precision=bf16
  ;;
pure)
  (cd "$repo" && timeout 60 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_swiglu.py packages/loongforge-kernels/tests/test_linear_cross_entropy.py \
      packages/loongforge-kernels/tests/test_grouped_qkv_rope.py packages/loongforge-kernels/tests/test_rms_norm.py \
      packages/loongforge-kernels/tests/test_gpu_model_shapes.py 2>&1 | tail -n 3)
  liger_only="--skip hf_eager --skip hf_compile --rounds 1"
  llm_bench 160 --config bench_llama_1b $liger_only --profile-rows 30 --trace /tmp/llama_1b_trace.json train.precision=bf16-pure
  timeout 30 python3 "$repo/bench/trace_gaps.py" /tmp/llama_1b_trace.json --gaps 30 --min-gap-us 30
  llm_bench 110 --config train_0_5b $liger_only --profile-rows 20 train.precision=bf16-pure
  llm_bench 170 --config bench_qwen3_4b $liger_only --profile-rows 0 train.precision=bf16-pure
  ;;
pure-short)
  (cd "$repo" && timeout 60 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_embedding_grad.py packages/loongforge-kernels/tests/test_rms_norm.py \
      packages/loongforge-kernels/tests/test_gpu_model_shapes.py 2>&1 | tail -n 3)
  liger_only="--skip hf_eager --skip hf_compile --rounds 1"
  llm_bench 110 --config train_0_5b $liger_only --profile-rows 25 train.precision=bf16-pure
  llm_bench 120 --config bench_llama_1b $liger_only --profile-rows 0 train.precision=bf16-pure
  ;;
cases-b)
  llm_bench 120 --config train_0_5b --skip hf_eager --skip hf_compile --rounds 1 --profile-rows 0 train.precision=bf16
  llm_bench 200 --config bench_qwen3_4b --skip hf_eager --skip hf_compile --rounds 1 --profile-rows 25 \
      train.precision=bf16-pure
  if python3 -c 'import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100 * 2**30)'; then
    llm_bench 200 --config bench_qwen3_4b --skip hf_eager --skip hf_compile --rounds 1 --profile-rows 0 \
        train.precision=bf16
  else
    echo "bench_qwen3_4b in mixed precision: left out (its fp32 main weights, gradients and AdamW state need an H200)"
  fi
  ;;
short)
  (cd "$repo" && timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_adamw.py packages/loongforge-kernels/tests/test_grouped_qkv_rope.py \
      packages/loongforge-kernels/tests/test_linear_cross_entropy.py 2>&1 | tail -n 3)
  liger_only="--skip hf_eager --skip hf_compile --rounds 1"
  llm_bench 150 --config bench_llama_1b $liger_only --profile-rows 30 train.precision=bf16-pure
  llm_bench 100 --config train_0_5b $liger_only --profile-rows 0 train.precision=bf16-pure
  llm_bench 150 --config bench_llama_1b $liger_only --profile-rows 0 --fp8 blockwise train.precision=bf16
  llm_bench 100 --config train_0_5b $liger_only --profile-rows 0 train.precision=bf16
  llm_bench 180 --config bench_qwen3_4b $liger_only --profile-rows 0 train.precision=bf16-pure
  ;;
shortest)
  (cd "$repo" && timeout 60 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_adamw.py 2>&1 | tail -n 2)
  liger_only="--skip hf_eager --skip hf_compile --rounds 1"
  llm_bench 120 --config bench_llama_1b $liger_only --profile-rows 25 --variant adamw=train.optimizer_kernel=loongforge \
      train.precision=bf16-pure
  llm_bench 120 --config bench_llama_1b $liger_only --profile-rows 0 --fp8 blockwise train.precision=bf16
  llm_bench 80 --config train_0_5b $liger_only --profile-rows 0 train.precision=bf16-pure
  ;;
fp8)
  (cd "$repo" && timeout 60 python3 -m pytest -q -rf --tb=line -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_fp8_gpu.py 2>&1 | tail -n 25)
  bench 40 python3 "$repo/bench/fp8_quantisers.py"
  liger_only="--skip hf_eager --skip hf_compile --rounds 1"
  llm_bench 170 --config bench_llama_1b $liger_only --profile-rows 0 --fp8 blockwise train.precision=bf16-pure
  llm_bench 90 --config bench_llama_1b --skip hf_eager --skip hf_compile --skip hf_liger --rounds 1 --profile-rows 40 \
      fp8=blockwise train.precision=bf16-pure
  ;;
host)
  bench 60 python3 "$repo/bench/host_overhead.py"
  llm_bench 170 --config bench_llama_1b --skip hf_eager --skip hf_compile --rounds 1 --profile-rows 20 \
      --trace /tmp/llama_1b_trace.json train.precision=bf16-pure
  timeout 30 python3 "$repo/bench/trace_gaps.py" /tmp/llama_1b_trace.json --gaps 20 --min-gap-us 30
  ;;
pair)
  liger_only="--skip hf_eager --skip hf_compile --rounds 1"
  llm_bench 100 --config bench_llama_1b $liger_only --profile-rows 0 train.precision=bf16-pure
  llm_bench 90 --config bench_llama_1b $liger_only --profile-rows 0 train.precision=bf16
  ;;
*)
  echo "unknown stage $stage"; exit 2
  ;;
esac
