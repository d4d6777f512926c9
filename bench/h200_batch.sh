#!/usr/bin/env bash
# One batched session on a CUDA machine (an H200 or H100), in stages that each fit one 10-minute
# device call:
#
#   bash bench/h200_batch.sh check    # correctness: GPU-marked tests (compiled Triton), every CLI trains
#
# The machine has torch, triton and transformers but no PyPI: the missing wheels travel in .whl/
# (megatron-core, omegaconf, hydra-core, antlr4, diffusers, pytest and its plugins, tensorboard and
# its deps, and LoongForge's own wheels from `uv build --wheel --package loongforge-<name> -o .whl`).
# Everything printed also goes to $OUT/<stage>.log.
set -uo pipefail
stage=${1:?usage: h200_batch.sh check}
OUT=${OUT:-/tmp/lf-h200}
mkdir -p "$OUT"
exec > >(tee "$OUT/$stage.log") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LOONGFORGE_CACHE=/tmp/lf-cache
cd "$(mktemp -d)"   # run dirs land here, not in the repository copy
repo=$OLDPWD

section() { printf '\n===== %s =====\n' "$*"; }
# a CLI run: the command, its exit code and the last lines it printed
cli() {
  section "$*"
  local log; log=$(mktemp)
  timeout 420 python3 -m "$@" >"$log" 2>&1; local rc=$?
  tail -n 8 "$log"; echo "exit code: $rc"
}

case $stage in
check)
  section environment
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers, megatron.core, diffusers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "megatron-core", megatron.core.__version__, "diffusers", diffusers.__version__)'

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
*) echo "unknown stage $stage"; exit 2 ;;
esac
