#!/usr/bin/env bash
# One batched session on a CUDA machine (an H200 or H100), in stages that each fit one 10-minute
# device call:
#
#   bash bench/h200_batch.sh check    # correctness: GPU-marked tests (compiled Triton), every CLI trains
#   bash bench/h200_batch.sh bench-a  # lf-llm bench (HF + compile, + Liger), lf-vlm bench (transformers, compiled)
#   python3 bench/liger_check.py      # (before trusting hf_liger) Liger's loss per kernel, eager and compiled
#   bash bench/h200_batch.sh bench-b  # lf-diffusion bench (diffusers, compile_repeated_blocks), DSA, FP8 GEMMs
#   bash bench/h200_batch.sh dsa      # the DSA kernels' GPU tests, then bench/dsa_throughput.py at 128 heads, 32K and 64K
#   bash bench/h200_batch.sh embodied # lf-embodied bench --against-lerobot (needs lerobot and its imports in .whl-emb/
#                                     # and .whl-av/), detached: it outlasts one call, see the stage
#   bash bench/h200_batch.sh embodied-eager # the same against LeRobot uncompiled (--lerobot-compile-mode none), in one call
#                                     # (PRECISION=bf16-pure: ours in pure bf16)
#   bash bench/h200_batch.sh wait     # the detached embodied run: wait for it (one call's worth), then its log
#   bash bench/h200_batch.sh long     # train_0_5b at 32K and 128K tokens: plain, activation offload, ChunkPipe
#
# Each bench prints its baseline's settings, both sides' first-step losses and peak memory, and the
# ratios; the tables in docs/benchmarks.md and the READMEs are copied from these logs.
#
# The machine has torch, triton and transformers but no PyPI: the missing wheels travel in .whl/
# (megatron-core, omegaconf, hydra-core, antlr4, diffusers, pytest and its plugins, tensorboard and
# its deps, and LoongForge's own wheels from `uv build --wheel --package loongforge-<name> -o .whl`).
# PyAV (39 MB) travels apart in .whl-av/, carried only by the calls that decode video or import
# LeRobot (check, embodied): every carried .whl-*/ folder is installed. Everything printed also goes
# to $OUT/<stage>.log.
set -uo pipefail
stage=${1:?usage: h200_batch.sh check|bench-a|bench-b|dsa|embodied|embodied-eager|wait|long}
OUT=${OUT:-/tmp/lf-h200}
mkdir -p "$OUT"
exec > >(tee "$OUT/$stage.log") 2>&1

# .whl-emb/ and .whl-av/ (the embodied stage's extra wheels: lerobot, datasets, draccus, gymnasium,
# PyAV and their imports) travel only with that stage's calls, the 64 MiB limit being what it is
if [ "$stage" != wait ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls .whl/*.whl .whl-*/*.whl 2>/dev/null) || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LOONGFORGE_CACHE=/tmp/lf-cache
cd "$(mktemp -d)"   # run dirs land here, not in the repository copy
repo=$OLDPWD

section() { printf '\n===== %s =====\n' "$*"; }
# a CLI run: the command, its exit code and the last lines it printed
cli() {
  section "$*"
  local log; log=$(mktemp)
  timeout 200 python3 -m "$@" >"$log" 2>&1; local rc=$?
  tail -n 8 "$log"; echo "exit code: $rc"
}
# a bench: everything it prints, under a time limit (seconds) so the stage fits its device call
bench() {
  local limit=$1; shift
  section "$* (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"; echo "exit code: $? after $((SECONDS - t0)) s"
}
environment() {
  section environment
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton, transformers, megatron.core, diffusers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "megatron-core", megatron.core.__version__, "diffusers", diffusers.__version__)'
  python3 -m pip list 2>/dev/null >"$OUT/pip-list.txt"
}

case $stage in
check)
  environment

  section "GPU-marked tests (compiled kernels)"
  (cd "$repo" && timeout 300 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests packages/loongforge-diffusion/tests packages/loongforge-llm/tests 2>&1 | tail -n 25)

  cli loongforge.llm.cli train train.steps=20 log.interval=5 checkpoint.save=false log.run_dir=llm-debug
  cli loongforge.llm.cli train --config train_0_5b train.steps=10 log.run_dir=llm-05b
  cli loongforge.llm.cli train --config train_0_5b train.steps=10 fp8=blockwise log.run_dir=llm-05b-fp8
  cli loongforge.llm.cli train --config train_0_5b train.steps=6 fp8=adaptive checkpoint.save=true checkpoint.interval=3 train.exit_interval=3 log.run_dir=llm-05b-fp8a
  cli loongforge.llm.cli train --config train_0_5b train.steps=6 fp8=adaptive checkpoint.save=true checkpoint.interval=3 log.run_dir=llm-05b-fp8a
  cli loongforge.llm.cli train --config train_qwen3_moe_debug train.steps=10 checkpoint.save=false log.run_dir=llm-moe
  cli loongforge.diffusion.cli train train.steps=40 log.run_dir=diffusion-tiny
  cli loongforge.vlm.cli train train.steps=20 log.run_dir=vlm-debug
  ;;
bench-a)
  environment
  bench 230 python3 "$repo/bench/llm_throughput.py" --skip hf_eager
  # one round: transformers' compiled Qwen2.5-VL takes ~150 s to compile on the H100
  bench 250 python3 "$repo/bench/vlm_throughput.py" --skip hf_eager --rounds 1
  ;;
bench-b)
  environment
  bench 280 python3 -m loongforge.diffusion.cli bench --config wan2_1_t2v_1_3b --steps 10 --profile-rows 0 \
      model.num_layers=4 sample.num_frames=33 sample.height=480 sample.width=832
  bench 150 python3 "$repo/bench/dsa_throughput.py" --seqs 8192,32768,65536
  bench 100 python3 "$repo/bench/fp8_gemm.py" --steps 50
  ;;
dsa)
  environment
  # the sparse MLA backward sums the key grad over every head before its one atomic scatter: its
  # bf16 results against the references first, then DeepSeek-V3.2's 128 heads against dense MLA
  (cd "$repo" && timeout 200 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      packages/loongforge-kernels/tests/test_dsa_gpu.py -k "${DSA_TESTS:-8192-128}" 2>&1 | tail -n 15)
  # DSA_BENCH=0: the tests only (they need no quiet device: e.g. while the embodied bench compiles)
  [ "${DSA_BENCH:-1}" = 0 ] || \
    bench 200 python3 "$repo/bench/dsa_throughput.py" --seqs 32768,65536 --heads 128 --layers 1 --iters 2 --variants dense,dsa
  ;;
long)
  environment
  # one sequence per step; the metrics carry tokens/s, peak_memory_gib and offload_gib per step
  bench 60 python3 "$repo/bench/chunk_attention.py" --seq 32768 --chunk 4096
  # (offload N = the first N of 8 layers; ChunkPipe in chunks of 4096 tokens)
  for seq in 32768 131072; do
    for variant in "offload0 train.offload_layers=0" "offload4 train.offload_layers=4" \
                   "chunks$((seq / 4096)) train.seq_chunks=$((seq / 4096))"; do
      set -- $variant
      run=llm-$seq-$1
      cli loongforge.llm.cli train --config train_0_5b train.seq_length=$seq model.max_position_embeddings=$seq \
          train.global_batch_size=1 train.micro_batch_size=1 train.steps=6 "$2" \
          checkpoint.save=false log.progress=false log.interval=1 log.run_dir=$run
      python3 - "$run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])][2:]
if rows:
    print(sys.argv[1].split("/")[0], "median tokens/s", sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2],
          "peak GiB", max(r["peak_memory_gib"] for r in rows), "offloaded GiB", rows[-1].get("offload_gib", 0))
PY
    done
  done
  ;;
embodied)
  environment
  # LeRobot's default compile mode for PI05, max-autotune, does not run on torch 2.11: on one H100
  # (2026-12-05) its GEMM autotuning ran past three 10-minute calls (inductor's caches kept between
  # them), and the compiled forward then stopped with an illegal memory access in inductor's
  # split-scan kernel for the masks' cumsum (max-autotune's coordinate-descent tuning shrinks that
  # kernel's R0_BLOCK below what its workspace was sized for; pytorch/pytorch#197493). So LeRobot
  # compiles in torch.compile's default mode here (LEROBOT_COMPILE_MODE to change it), which the
  # printed recipe marks. Compilation still outlasts one call, so the bench runs detached (setsid:
  # it outlives this call, not the machine) into /tmp/lf-embodied, and `wait` calls keep the
  # machine busy until it is done. Inductor's and Triton's caches go to /tmp/lf-compile-cache.
  mkdir -p /tmp/lf-embodied
  TORCHINDUCTOR_CACHE_DIR=/tmp/lf-compile-cache/inductor TRITON_CACHE_DIR=/tmp/lf-compile-cache/triton \
    setsid bash -c "python3 '$repo/bench/embodied_throughput.py' --rounds 1 --profile-rows 30 \
                      --lerobot-compile-mode ${LEROBOT_COMPILE_MODE:-default} >/tmp/lf-embodied/bench.log 2>&1; \
                    echo \"exit code: \$?\" >>/tmp/lf-embodied/bench.log; touch /tmp/lf-embodied/done" </dev/null >/dev/null 2>&1 &
  echo "started detached (pid $!); follow it with: bash bench/h200_batch.sh wait"
  ;;
embodied-eager)
  environment
  # LeRobot uncompiled (PI05Config's default compile_model=false), ours as lf-embodied train runs it:
  # no inductor autotuning on LeRobot's side, so it fits one call
  # (PRECISION=bf16-pure: ours in pure bf16, closer to LeRobot's bf16 backbone; took 519 s in mixed precision)
  bench 540 python3 "$repo/bench/embodied_throughput.py" --rounds 1 --profile-rows 25 --lerobot-compile-mode none \
      ${PRECISION:+train.precision=$PRECISION}
  ;;
wait)
  # up to WAIT seconds (default 560) for the detached embodied bench, then its log without the
  # autotuning chatter (the whole log comes back as $OUT/embodied-bench.log)
  for _ in $(seq "${WAIT:-560}"); do [ -f /tmp/lf-embodied/done ] && break; sleep 1; done
  [ -f /tmp/lf-embodied/done ] && echo "finished" || echo "still running"
  cp /tmp/lf-embodied/bench.log "$OUT/embodied-bench.log" 2>/dev/null
  grep -v -E "AUTOTUNE|triton_(mm|bmm|convolution|tem)_|strides:|dtypes:|^  (mm|bmm|addmm|bias_addmm|convolution|_mm_plus_mm) |Autotune Choices|num_choices|select_algorithm" \
      /tmp/lf-embodied/bench.log 2>/dev/null | tail -n 120
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
