"""Compile every kernel ahead of time for a CUDA target, without a GPU (run by test_gpu_compile).

The interpreter runs kernels as numpy code, so it misses what only the compiler checks (types of
loop-carried values, constexpr branches, pointer arithmetic). This script takes each kernel
through Triton's full pipeline down to a cubin (ptxas included) for sm_90, in bf16 and fp32,
with every constexpr branch taken, and prints one line per kernel built.

``python compile_for_gpu.py I N`` builds only every N-th kernel starting at the I-th, so N
processes share the builds (the test runs two, one per core).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_for_gpu: run without TRITON_INTERPRET=1 (interpreted kernels do not compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from loongforge.kernels import adamw as aw  # noqa: E402
from loongforge.kernels import dsa_indexer as dsi  # noqa: E402
from loongforge.kernels import fp8_cast as fc  # noqa: E402
from loongforge.kernels import fp8_gemm as fg  # noqa: E402
from loongforge.kernels import gelu as ge  # noqa: E402
from loongforge.kernels import grouped_qkv_rope as gq  # noqa: E402
from loongforge.kernels import layer_norm as ln  # noqa: E402
from loongforge.kernels import linear_cross_entropy as lce  # noqa: E402
from loongforge.kernels import qk_norm_rope as qk  # noqa: E402
from loongforge.kernels import rms_norm as rn  # noqa: E402
from loongforge.kernels import rope as rp  # noqa: E402
from loongforge.kernels import sparse_mla as sm  # noqa: E402
from loongforge.kernels import swiglu as sw  # noqa: E402
from loongforge.kernels.launch import warps_for  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARD, N_SHARDS = (int(a) for a in sys.argv[1:3]) if len(sys.argv) >= 3 else (0, 1)
_builds = 0  # build() calls so far, built or left to another shard
MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def build(
    fn, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3, aligned: tuple = ()
) -> None:
    """Compile ``fn`` as Triton's JIT would for 16-byte-aligned pointers and strides (and the ints in
    ``aligned``) that are multiples of 16: the usual case, and the one whose loads are pipelined."""
    global _builds
    _builds += 1
    if (_builds - 1) % N_SHARDS != SHARD:
        return
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    hinted = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name not in constexprs and (types[name].startswith("*") or name.startswith("stride") or name in aligned)
    }
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs=constexprs, attrs=hinted), target=TARGET,
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    shared = kernel.metadata.shared
    if shared > MAX_SHARED:
        sys.exit(f"{fn.__name__} {constexprs}: needs {shared} bytes of shared memory, sm_90 has {MAX_SHARED}")
    dtype = next((types[k] for k in ("X", "GU", "LOGITS", "DY", "DG", "H", "Q", "A", "W") if k in types), "")
    print(f"compiled {fn.__name__} {dtype} {constexprs} shared={shared}")


def build_dsa(dtype: str) -> None:
    """The sparse MLA and indexer kernels at DeepSeek-V3.2's sizes (latent 512, rope 64, indexer dim 128)."""
    i32, p = "i32", f"*{dtype}"
    precision = "ieee" if dtype == "fp32" else "tf32"
    elem_bytes = 4 if dtype == "fp32" else 2
    sizes = dict(D_V=512, D_ROPE=64, BLOCK_DV=512, BLOCK_DR=64, PRECISION=precision)
    bwd = dict(Q=p, KV=p, IDX="*i32", O=p, DO=p, LSE="*fp32", DQ=p, DKV="*fp32", PB=p, DSB=p, n_heads=i32,
               topk=i32, scale="fp32", scale_log2="fp32", stride_qb=i32, stride_qs=i32, stride_qh=i32, stride_kvb=i32,
               stride_kvs=i32, stride_ib=i32, stride_is=i32, stride_ob=i32, stride_os=i32, stride_oh=i32,
               stride_dob=i32, stride_dos=i32, stride_doh=i32, stride_lb=i32, stride_ls=i32, stride_dqb=i32,
               stride_dqs=i32, stride_dqh=i32, stride_dkvb=i32, stride_dkvs=i32, stride_pb=i32, stride_ps=i32,
               stride_ph=i32)
    for block_h in (16, 32, 64) if dtype == "bf16" else (16,):
        common = dict(sizes, BLOCK_H=block_h)
        build(
            sm._sparse_mla_fwd,
            dict(Q=p, KV=p, IDX="*i32", O=p, LSE="*fp32", n_heads=i32, topk=i32, scale_log2="fp32",
                 stride_qb=i32, stride_qs=i32, stride_qh=i32, stride_kvb=i32, stride_kvs=i32, stride_ib=i32,
                 stride_is=i32, stride_ob=i32, stride_os=i32, stride_oh=i32, stride_lb=i32, stride_ls=i32),
            dict(common, BLOCK_N=sm.forward_keys(elem_bytes)), num_warps=8, num_stages=2, aligned=("topk",),
        )
        if block_h > 32:  # the single-kernel backward takes at most 32 heads per program
            continue
        # the query grad with the key grad (one head block of 16 or 32 heads)
        build(
            sm._sparse_mla_bwd_dq, bwd,
            dict(common, BLOCK_N=sm.BLOCK_N_FUSED, WITH_DKV=True), num_warps=sm.FUSED_WARPS, num_stages=1,
            aligned=("topk",),
        )
    for heads in (16, 128) if dtype == "bf16" else (16,):  # the indexer loss's target at its blocks
        block_h, block_n, stages = sm.target_blocks(heads, elem_bytes)
        for lse_given in (False, True):  # in two passes, or one from the forward's lse
            build(
                sm._sparse_mla_head_mean_probs,
                dict(Q=p, KV=p, IDX="*i32", LSE="*fp32", P="*fp32", n_heads=i32, topk=i32, scale_log2="fp32",
                     inv_heads="fp32", stride_qb=i32, stride_qs=i32, stride_qh=i32, stride_kvb=i32, stride_kvs=i32,
                     stride_ib=i32, stride_is=i32, stride_lb=i32, stride_ls=i32, stride_pb=i32, stride_ps=i32),
                dict(sizes, BLOCK_H=block_h, BLOCK_N=block_n, LSE_GIVEN=lse_given), num_warps=8, num_stages=stages,
                aligned=("topk",),
            )
    # the two-kernel backward: the query grad storing the probabilities and logit grads, then the key grad
    blocks = sm.backward_blocks(elem_bytes)
    build(
        sm._sparse_mla_bwd_dq, bwd,
        dict(sizes, BLOCK_H=blocks.dq_heads, BLOCK_N=blocks.dq_keys, WITH_DKV=False), num_warps=blocks.dq_warps,
        num_stages=blocks.dq_stages, aligned=("topk",),
    )
    build(
        sm._sparse_mla_bwd_dkv,
        dict(Q=p, IDX="*i32", DO=p, PB=p, DSB=p, DKV="*fp32", n_heads=i32, topk=i32, n_key_blocks=i32,
             stride_qb=i32, stride_qs=i32, stride_qh=i32, stride_ib=i32, stride_is=i32, stride_dob=i32,
             stride_dos=i32, stride_doh=i32, stride_pb=i32, stride_ps=i32, stride_ph=i32, stride_dkvb=i32,
             stride_dkvs=i32),
        dict(D=576, D_V=512, BLOCK_H=blocks.dkv_heads, BLOCK_N=blocks.dkv_keys, BLOCK_D=blocks.dkv_cols,
             PRECISION=precision),
        num_warps=blocks.dkv_warps, num_stages=1,
        aligned=("topk",),
    )
    gather = dict(Q=p, K=p, W="*fp32", IDX="*i32", n_heads=i32, topk=i32, stride_qb=i32, stride_qs=i32, stride_qh=i32,
                  stride_kb=i32, stride_ks=i32, stride_wb=i32, stride_ws=i32, stride_ib=i32, stride_is=i32)
    gather_blocks = dict(DIM=128, BLOCK_HI=64, BLOCK_D=128, BLOCK_N=dsi.GATHER_BLOCK_N, PRECISION=precision)
    build(dsi._indexer_gather_scores, dict(gather, OUT="*fp32", stride_ob=i32, stride_os=i32), gather_blocks,
          num_warps=dsi.GATHER_WARPS, aligned=("topk",))
    build(
        dsi._indexer_gather_bwd,
        dict(gather, DS="*fp32", DQ=p, DK="*fp32", DW="*fp32", stride_dsb=i32, stride_dss=i32, stride_dkb=i32,
             stride_dks=i32),
        gather_blocks, num_warps=dsi.GATHER_WARPS, aligned=("topk",),
    )
    build(
        dsi._indexer_scores,
        dict(Q=p, K=p, W="*fp32", OUT="*fp32", t0=i32, n_rows=i32, n_cols=i32, offset=i32, n_heads=i32,
             stride_qb=i32, stride_qs=i32, stride_qh=i32, stride_kb=i32, stride_ks=i32, stride_wb=i32, stride_ws=i32,
             stride_ob=i32, stride_os=i32),
        dict(DIM=128, BLOCK_D=128, BLOCK_M=dsi.BLOCK_M, BLOCK_N=dsi.BLOCK_N, PRECISION=precision),
        aligned=("n_rows", "n_cols"),
    )


def build_fp8() -> None:
    """The FP8 quantisers (bf16 and fp32 inputs), the tensor-wise cast-transpose (e4m3/e5m2, with
    and without the GELU prologue) and the blockwise-scaled GEMM (both B scalings)."""
    i32, f8 = "i32", "*fp8e4nv"
    limits = dict(AMAX_FLOOR=fg.AMAX_FLOOR, FP8_MAX=fg.FP8_MAX, INV_FP8_MAX=fg.INV_FP8_MAX)
    for dtype in ("bf16", "fp32"):
        rows = dict(n_rows=i32, n_cols=i32)
        build(fg._quant_rows, dict(X=f"*{dtype}", Q=f8, S="*fp32", stride_x=i32, stride_q=i32, stride_s=i32, stride_sk=i32,
                                   **rows),
              dict(limits, BLOCK_R=fg.QUANT_ROWS, BLOCK_C=fg.BLOCK))
        build(fg._quant_cols_transposed,
              dict(X=f"*{dtype}", QT=f8, ST="*fp32", stride_x=i32, stride_qt=i32, stride_st=i32, stride_stk=i32, **rows),
              dict(limits, BLOCK_R=fg.BLOCK, BLOCK_C=64))
        build(fg._quant_rows_and_cols,
              dict(X=f"*{dtype}", Q=f8, S="*fp32", QT=f8, ST="*fp32", stride_x=i32, stride_q=i32, stride_s=i32,
                   stride_sk=i32, stride_qt=i32, stride_st=i32, stride_stk=i32, **rows),
              dict(limits, BLOCK=fg.BLOCK, SUB_R=fg.QUANT_ROWS), num_warps=4)
        build(fg._quant_blocks, dict(W=f"*{dtype}", Q=f8, S="*fp32", stride_w=i32, stride_q=i32, stride_s=i32, **rows),
              dict(limits, BLOCK=fg.BLOCK), num_warps=8)
    for dtype in ("bf16", "fp32"):  # tensor-wise cast-transpose (plain and with the GELU prologue)
        for q_type, fmax in ((f8, 448.0), ("*fp8e5", 57344.0)):
            for gelu in (False, True):
                build(fc.cast_transpose_kernel,
                      dict(X=f"*{dtype}", Q=q_type, QT=q_type, S="*fp32", n_rows=i32, n_cols=i32, n_rows_t=i32,
                           stride_x=i32),
                      dict(FMAX=fmax, GELU=gelu, TRANSPOSE_BY_LOAD=dtype == "fp32", BLOCK_R=fc.BLOCK_ROWS,
                           BLOCK_C=fc.BLOCK_COLS))
    for b_blocked, out in ((True, "bf16"), (False, "fp32")):
        build(
            fg._fp8_gemm,
            dict(A=f8, B=f8, SA="*fp32", SB="*fp32", C=f"*{out}", M=i32, N=i32, K=i32, stride_am=i32, stride_bn=i32,
                 stride_cm=i32, stride_sa=i32, stride_sak=i32, stride_sb=i32, stride_sbk=i32),
            dict(B_BLOCKED=b_blocked, BLOCK_M=fg.GEMM_BLOCK_M, BLOCK_N=fg.GEMM_BLOCK_N, BLOCK_K=fg.BLOCK,
                 GROUP_M=fg.GEMM_GROUP_M),
            num_warps=8, num_stages=3, aligned=("M", "N", "K"),
        )


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
        for backward in (False, True):
            for has_pass in (False, True):
                build(
                    gq._grouped_qkv_rope,
                    dict(QKV=p, COS="*fp32", SIN="*fp32", Q=p, K=p, V=p, batch=i32, per_group=i32, n_heads=i32,
                         half=i32, n_pass=i32, stride_xs=i32, stride_xb=i32, stride_cs=i32, stride_cb=i32,
                         stride_qs=i32, stride_qb=i32, stride_qh=i32, stride_ks=i32, stride_kb=i32, stride_kh=i32,
                         stride_vs=i32, stride_vb=i32, stride_vh=i32),
                    dict(HEAD_DIM=128, BACKWARD=backward, HAS_PASS=has_pass, BLOCK_H=64, BLOCK_HALF=32 if has_pass else 64,
                         BLOCK_PASS=64),
                )
            # Qwen3-4B's rows: 8 groups of 4 query heads + key + value, head dim 128, full rotary
            build(
                gq._grouped_qkv_norm_rope,
                dict(QKV=p, COS="*fp32", SIN="*fp32", QW=p, KW=p, Q=p, K=p, V=p, DQKV=p, DWQ="*fp32", DWK="*fp32",
                     batch=i32, per_group=i32, n_heads=i32, half=i32, eps="fp32", stride_xs=i32, stride_xb=i32,
                     stride_cs=i32, stride_cb=i32, stride_ds=i32, stride_db=i32, stride_qs=i32, stride_qb=i32,
                     stride_qh=i32, stride_ks=i32, stride_kb=i32, stride_kh=i32, stride_vs=i32, stride_vb=i32,
                     stride_vh=i32),
                dict(HEAD_DIM=128, BACKWARD=backward, HAS_PASS=False, BLOCK_H=64, BLOCK_HALF=64, BLOCK_PASS=1),
                num_warps=16,
            )
        tl = triton.language
        pairs = ((tl.bfloat16, tl.bfloat16), (tl.float32, tl.bfloat16)) if dtype == "bf16" else ((tl.float32, tl.float32),)
        for p_dtype, g_dtype in pairs:  # the param (and moments) and gradient dtypes, aligned and not
            for aligned in (True, False):
                width = {tl.bfloat16: 8, tl.float32: 4}
                build(
                    aw._adamw_tensor_list,
                    dict(TABLE="*i64", n_tensors=i32, SCALE="*fp32", SKIP="*fp32", P_BASE=f"*{p_dtype}", G_BASE=f"*{g_dtype}",
                         M_BASE=f"*{p_dtype}", V_BASE=f"*{p_dtype}", lr="fp32", beta1="fp32", beta2="fp32", eps="fp32",
                         weight_decay="fp32", log_beta1="fp32", log_beta2="fp32"),
                    dict(SEARCH_STEPS=8, BLOCK=aw.BLOCK, P_ALIGN=width[p_dtype] if aligned else 1,
                         G_ALIGN=width[g_dtype] if aligned else 1, N_ALIGN=16 if aligned else 1, HAS_SKIP=aligned),
                    num_warps=8,
                )
        build(
            rp._rope_cos_sin_grad,
            dict(DY=p, X=p, DCOS="*fp32", DSIN="*fp32", n_heads=i32, half=i32, stride_dyt=i32, stride_dyh=i32,
                 stride_xt=i32, stride_xh=i32),
            dict(BLOCK_H=16, BLOCK_HALF=64),
        )
        build(sw._swiglu_fwd, dict(GU=p, Y=p, n_cols=i32, stride_gu=i32, stride_y=i32), dict(BLOCK=sw.BLOCK_COLS))
        for write_y in (True, False):
            build(
                sw._swiglu_bwd,
                dict(DY=p, GU=p, DGU=p, Y=p, n_cols=i32, stride_dy=i32, stride_gu=i32, stride_dgu=i32, stride_y=i32),
                dict(BLOCK=sw.BLOCK_COLS, WRITE_Y=write_y),
            )
        for write_grad in (True, False):
            build(
                lce._ce_forward,
                dict(LOGITS=p, LABELS="*i64", LOSS="*fp32", LSE="*fp32", n_vocab=i32, stride_logits=i32,
                     ignore_index=i32),
                dict(WRITE_GRAD=write_grad, BLOCK=lce.BLOCK_VOCAB), num_warps=8,
            )
        build(lce._scale_in_place, dict(X=p, FACTOR="*fp32", n=i32), dict(BLOCK=lce.SCALE_BLOCK))
        build(
            lce._ce_backward_in_place,
            dict(LOGITS=p, LABELS="*i64", LSE="*fp32", DLOSS="*fp32", n_vocab=i32, stride_logits=i32,
                 stride_dloss=i32, ignore_index=i32),
            dict(BLOCK=lce.BLOCK_VOCAB), num_warps=8,
        )
        for with_output in (True, False):
            build(ge._gelu_tanh_backward,
                  dict(DG=p, H=p, DH=p, G=p, PARTIAL="*fp32", AMAX="*fp32", n_rows=i32, n_cols=i32,
                       rows_per_program=i32),
                  dict(WITH_OUTPUT=with_output, BLOCK_M=ge.BLOCK_M, BLOCK_N=ge.BLOCK_N), num_warps=ge.NUM_WARPS)
        build(ge._gelu_amax, dict(H=p, AMAX="*fp32", numel=i32), dict(BLOCK=ge.AMAX_BLOCK), num_warps=8)
        # Wan-1.3B's width of 1536 (768 channel pairs), Wan-14B's 5120; a width that is a multiple of
        # 16, as the JIT specialises it, lets rows load 16 bytes at a time
        for block_p in (1024, 4096):
            build(qk._qk_norm_rope_fwd,
                  dict(QKV=p, WQ="*fp32", WK="*fp32", COS="*fp32", SIN="*fp32", Q=p, K=p, n_rows=i32, width=i32,
                       pairs_per_head=i32, stride_qkv=i32, stride_cos=i32, stride_sin=i32, eps="fp32"),
                  dict(BLOCK_M=qk.FORWARD_ROWS, BLOCK_P=block_p), num_warps=warps_for(2 * qk.FORWARD_ROWS * block_p),
                  aligned=("width",))
            build(qk._qk_norm_rope_bwd,
                  dict(DQ=p, DK=p, DV=p, QKV=p, WQ="*fp32", WK="*fp32", COS="*fp32", SIN="*fp32", DQKV=p,
                       PARTIAL="*fp32", n_rows=i32, width=i32, pairs_per_head=i32, rows_per_program=i32, stride_dq=i32,
                       stride_dk=i32, stride_dv=i32, stride_qkv=i32, stride_cos=i32, stride_sin=i32, stride_dqkv=i32,
                       eps="fp32"),
                  dict(BLOCK_M=qk.BACKWARD_ROWS, BLOCK_P=block_p), num_warps=warps_for(2 * qk.BACKWARD_ROWS * block_p),
                  aligned=("width",))
        for has_index in (False, True):  # adaLN's LayerNorm at Wan-1.3B's width (1536), one sample or a pack
            build(ln._modulated_ln_fwd,
                  dict(X=p, W="*fp32", B="*fp32", INDEX="*i64", Y=p, n_rows=i32, width=i32, stride_x=i32, stride_w=i32,
                       stride_b=i32, stride_y=i32, eps="fp32"),
                  dict(HAS_INDEX=has_index, BLOCK_M=ln.FORWARD_ROWS, BLOCK_N=2048),
                  num_warps=warps_for(ln.FORWARD_ROWS * 2048), aligned=("width",))
            block_m = 1 if has_index else ln.BACKWARD_ROWS
            build(ln._modulated_ln_bwd,
                  dict(DY=p, X=p, W="*fp32", INDEX="*i64", DX=p, PARTIAL_W="*fp32", PARTIAL_B="*fp32", n_rows=i32,
                       width=i32, n_samples=i32, rows_per_program=i32, stride_dy=i32, stride_x=i32, stride_w=i32,
                       stride_dx=i32, eps="fp32"),
                  dict(HAS_INDEX=has_index, BLOCK_M=block_m, BLOCK_N=2048),
                  num_warps=warps_for(block_m * 2048), aligned=("width",))
        build_dsa(dtype)
    build_fp8()


if __name__ == "__main__":
    main()
