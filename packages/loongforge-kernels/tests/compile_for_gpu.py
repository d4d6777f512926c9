"""Compile every kernel ahead of time for a CUDA target, without a GPU (run by test_gpu_compile).

The interpreter runs kernels as numpy code, so it misses what only the compiler checks (types of
loop-carried values, constexpr branches, pointer arithmetic). This script takes each kernel
through Triton's full pipeline down to a cubin (ptxas included) for sm_90, in bf16 and fp32,
with every constexpr branch taken, and prints one line per kernel built.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_for_gpu: run without TRITON_INTERPRET=1 (interpreted kernels do not compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loongforge.kernels import linear_cross_entropy as lce  # noqa: E402
from loongforge.kernels import rms_norm as rn  # noqa: E402
from loongforge.kernels import rope as rp  # noqa: E402
from loongforge.kernels import swiglu as sw  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def build(fn, types: dict[str, str], constexprs: dict, num_warps: int = 4) -> None:
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=TARGET, options={"num_warps": num_warps})
    print(f"compiled {fn.__name__} {types.get('X', types.get('GU', types.get('LOGITS', types.get('DY'))))} {constexprs}")


def main() -> None:
    i32 = "i32"
    for dtype in ("bf16", "fp32"):
        p = f"*{dtype}"
        for has_residual in (True, False):
            build(
                rn._rms_norm_fwd,
                dict(X=p, R=p, S=p, Y=p, W=p, RSTD="*fp32", n_cols=i32, stride_x=i32, stride_r=i32, stride_s=i32,
                     stride_y=i32, eps="fp32"),
                dict(HAS_RESIDUAL=has_residual, BLOCK=2048),
            )
        for has_ds, has_dr in ((True, True), (True, False), (False, False)):
            build(
                rn._rms_norm_bwd,
                dict(DY=p, X=p, W=p, RSTD="*fp32", DS=p, DX=p, DR=p, DW_PARTIAL="*fp32", n_rows=i32, n_cols=i32,
                     rows_per_program=i32, stride_dy=i32, stride_x=i32, stride_ds=i32, stride_dx=i32, stride_dr=i32),
                dict(HAS_DS=has_ds, HAS_DR=has_dr, BLOCK=2048),
            )
        for transpose in (True, False):
            for has_pass in (True, False):
                build(
                    rp._rope_rotate,
                    dict(X=p, COS="*fp32", SIN="*fp32", Y=p, n_heads=i32, half=i32, n_pass=i32, stride_xt=i32,
                         stride_xh=i32, stride_yt=i32, stride_yh=i32, stride_ct=i32, stride_st=i32),
                    dict(TRANSPOSE=transpose, HAS_PASS=has_pass, BLOCK_H=16, BLOCK_HALF=64, BLOCK_PASS=64),
                )
        build(
            rp._rope_cos_sin_grad,
            dict(DY=p, X=p, DCOS="*fp32", DSIN="*fp32", n_heads=i32, half=i32, stride_dyt=i32, stride_dyh=i32,
                 stride_xt=i32, stride_xh=i32),
            dict(BLOCK_H=16, BLOCK_HALF=64),
        )
        build(sw._swiglu_fwd, dict(GU=p, Y=p, n_cols=i32, stride_gu=i32, stride_y=i32), dict(BLOCK=sw.BLOCK_COLS))
        build(
            sw._swiglu_bwd,
            dict(DY=p, GU=p, DGU=p, n_cols=i32, stride_dy=i32, stride_gu=i32, stride_dgu=i32),
            dict(BLOCK=sw.BLOCK_COLS),
        )
        build(
            lce._ce_forward,
            dict(LOGITS=p, LABELS="*i64", LOSS="*fp32", LSE="*fp32", n_vocab=i32, stride_logits=i32, ignore_index=i32),
            dict(BLOCK=lce.BLOCK_VOCAB), num_warps=8,
        )
        build(
            lce._ce_backward_in_place,
            dict(LOGITS=p, LABELS="*i64", LSE="*fp32", DLOSS="*fp32", n_vocab=i32, stride_logits=i32,
                 stride_dloss=i32, ignore_index=i32),
            dict(BLOCK=lce.BLOCK_VOCAB), num_warps=8,
        )


if __name__ == "__main__":
    main()
