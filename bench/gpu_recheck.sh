#!/usr/bin/env bash
# The GPU-marked kernel tests that failed in `h200_batch.sh check`, with their assertion messages,
# and the diffusion and VLM CLI runs (which need PyAV from .whl/).
set -uo pipefail
OUT=${OUT:-/tmp/lf-h200}; mkdir -p "$OUT"
exec > >(tee "$OUT/recheck.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LOONGFORGE_CACHE=/tmp/lf-cache
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="--import-mode=importlib" --tb=short -W ignore \
  packages/loongforge-kernels/tests/test_layer_norm.py packages/loongforge-kernels/tests/test_qk_norm_rope.py 2>&1 | grep -E "^E |Mismatch|Greatest|passed|failed|^FAILED" | head -60
cd "$(mktemp -d)"
for m in diffusion vlm; do
  echo "===== lf-$m train ====="
  timeout 200 python3 -m loongforge.$m.cli train train.steps=30 log.progress=false log.run_dir=$m 2>&1 | tail -n 6
  echo "exit code: $?"
done
