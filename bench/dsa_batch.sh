#!/usr/bin/env bash
# DeepSeek sparse attention (DSA) on one CUDA machine (H100 or H200), in one device call of < 9 minutes:
#
#   bash bench/dsa_batch.sh          (everything below)
#   bash bench/dsa_batch.sh kernels  (the GPU tests at 128 heads and the sparse MLA kernels alone: ~3 minutes)
#   bash bench/dsa_batch.sh quick    (the GPU tests at 128 heads, dense vs DSA at 16K-64K and the sparse
#                                     MLA kernels on one chunk of queries at 16K-64K: ~2-3 minutes)
#   bash bench/dsa_batch.sh one      (the GPU tests at 128 heads and the kernels at 32K alone: under 2 minutes)
#
# 1. the DSA kernels' GPU tests (bf16 at V3.2's sizes against the fp32 references: top-k, sparse MLA,
#    the absorbed op DSAttention runs, the indexer loss, the one-pass target) and the interpreter tests of test_sparse_mla.py
#    compiled for the GPU;
# 2. bench/dsa_throughput.py, 128 heads, one layer: dense against DSA at 16K, 32K and 64K tokens, with
#    where DSA's time goes at 32K (top-k, attention fwd / fwd+bwd, indexer loss) and a profiler table
#    of one DSA step at 32K;
# 3. bench/dsa_kernel_launches.py: the sparse MLA kernels alone on the last chunk of queries at 16K-64K:
#    forward, backward (query grad, then key grad) and the head-mean probabilities in two passes and in one
#    (from the forward's log-sum-exp);
# 4. 128K tokens (DSA, and dense beside it) where the GPU has more than 100 GiB (an H200).
#
# The machine has torch and triton but no PyPI: LoongForge's wheels travel in .whl/ (`uv build --wheel
# --package loongforge-<name> -o .whl` for core, llm and kernels), with pytest and its plugins. Everything
# printed also goes to $OUT/dsa.log.
set -uo pipefail
OUT=${OUT:-/tmp/lf-dsa-bench}
LOG=dsa.log
source "$(dirname "$0")/device_batch.sh"

section environment
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

tests="$repo/packages/loongforge-kernels/tests"
if [ "${1:-}" = kernels ]; then  # the GPU tests at 128 heads, then the kernels alone (no step timings): ~3 minutes
  (cd "$repo" && bench 100 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      "$tests/test_dsa_gpu.py" -k "8192-128" 2>&1 | tail -n 12)
  bench 100 python3 "$repo/bench/dsa_kernel_launches.py" --seqs 16384,32768,65536 --iters 2
  exit 0
fi
if [ "${1:-}" = one ]; then  # the GPU tests at 128 heads, then the kernels at 32K: the least a short call can check
  (cd "$repo" && bench 80 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      "$tests/test_dsa_gpu.py" -k "8192-128" 2>&1 | tail -n 12)
  bench 90 python3 "$repo/bench/dsa_kernel_launches.py" --seqs 32768 --iters 1
  exit 0
fi
if [ "${1:-}" = quick ]; then  # the GPU tests at 128 heads, dense vs DSA and the kernels at 16K-64K
  (cd "$repo" && bench 210 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
      "$tests/test_dsa_gpu.py" -k "8192-128" 2>&1 | tail -n 12)
  bench 150 python3 "$repo/bench/dsa_throughput.py" --seqs 16384,32768,65536 --heads 128 --layers 1 --iters 2 \
      --variants dense,dsa --breakdown-seq 0
  bench 120 python3 "$repo/bench/dsa_kernel_launches.py" --seqs 16384,32768,65536 --iters 2
  exit 0
fi
(cd "$repo" && bench 150 python3 -m pytest -q -s -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
    "$tests/test_dsa_gpu.py" -k "8192-128" 2>&1 | tail -n 30)
(cd "$repo" && bench 60 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="--import-mode=importlib" \
    "$tests/test_sparse_mla.py" 2>&1 | tail -n 5)

bench 200 python3 "$repo/bench/dsa_throughput.py" --seqs 16384,32768,65536 --heads 128 --layers 1 --iters 2 \
    --variants dense,dsa --breakdown-seq 32768 --profile-seq 32768 --profile-rows 30
bench 120 python3 "$repo/bench/dsa_kernel_launches.py" --seqs 16384,32768,65536 --iters 2

if python3 -c 'import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100 * 2**30)'; then
  bench 90 python3 "$repo/bench/dsa_throughput.py" --seqs 131072 --heads 128 --layers 1 --iters 1 \
      --variants dense,dsa --breakdown-seq 0
else
  echo "131072 tokens: left out (this GPU has less than 100 GiB)"
fi
