"""Every kernel compiles for a CUDA GPU (sm_90 cubin), checked on a machine without one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")
# dtypes x (rms fwd, rms bwd, rope rotate, rope grad, swiglu, ce, indexer scores, indexer gather fwd/bwd, GELU
# backward with and without its output, GELU amax, query/key norm + RoPE fwd and bwd at two widths, adaLN
# LayerNorm fwd and bwd for one sample or a pack) + sparse MLA fwd (bf16: 16/32/64 heads a program, fp32: 16) and
# the head-mean probs in two passes and in one from a given log-sum-exp (at 16 and 128 heads' blocks in bf16, 16 in fp32), bwd query grad (bf16: 16/32 heads with the key grad, 64 without; fp32: 16 with and without) and bwd
# key grad (one in each dtype) + FP8 quantisers (4: rows, columns, both, 128x128; x2 input dtypes), tensor-wise
# cast-transposes (x2 input dtypes x e4m3/e5m2 x GELU prologue or not) and GEMMs + the grouped QKV RoPE (x2 dtypes x forward/backward x pass-through or not),
# the loss forward's second form (x2 dtypes: with or without its gradient) and AdamW (bf16/bf16, fp32/bf16,
# fp32/fp32 params/grads, x2: 16-byte aligned or not), SwiGLU's backward writing its output and the loss
# backward's on-device factor, the grouped QKV norm + RoPE (forward and backward) (x2 dtypes each)
N_BUILDS = (2 * (2 + 3 + 4 + 1 + 2 + 2 + 3 + 3 + 4 + 4) + (7 + 3) + (3 + 2) + (1 + 1) + (2 * 4 + 2 * 2 * 2 + 2)
            + 2 * 4 + 2 + 2 * 3 + 2 * 2 + 2 * 2)


def _nvidia_backend_present() -> bool:
    spec = importlib.util.find_spec("triton")
    return spec is not None and (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _nvidia_backend_present(), reason="this triton install has no NVIDIA backend (ptxas)")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile from scratch, leave no cache behind
    shards = 2  # one process per core, each building every other kernel
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(i), str(shards)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(shards)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-4000:]
    stdout = "".join(out for out, _ in outputs)
    assert stdout.count("compiled ") == N_BUILDS, stdout
