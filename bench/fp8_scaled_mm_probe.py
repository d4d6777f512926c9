"""Which scale layouts ``torch._scaled_mm``'s blockwise FP8 path (cuBLASLt, sm_90) reads as we mean them.

Run on a CUDA machine:  python bench/fp8_scaled_mm_probe.py

For GEMMs ``C = dequant(A) @ dequant(B).T`` (A ``[M, K]`` with 1x128 scales; B ``[N, K]`` with 128x128
scales, a weight, or 1x128 scales, an activation in the weight-gradient GEMM) it quantises random
operands with loongforge-kernels' quantisers, then runs ``torch._scaled_mm`` with each candidate
layout of the scale tensors and prints the relative error against the dequantised fp32 product
(about 1e-3 is right; O(1) means the scales were read in another order), and the time of the
right ones against loongforge-kernels' Triton FP8 GEMM and a bf16 matmul.
"""

from __future__ import annotations

import torch


def main() -> None:
    from loongforge.kernels.fp8_gemm import quantize_1x128, quantize_128x128, triton_fp8_gemm

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuBLASLt {torch.backends.cuda.preferred_blas_library()}")
    for m, n, k in ((8192, 3072, 2048), (8192, 2048, 8192), (8192, 16384, 2048), (2048, 8192, 8192)):
        a = torch.randn(m, k, device="cuda")
        for blocked in (True, False):
            b = torch.randn(n, k, device="cuda")
            a_q, a_s = quantize_1x128(a)
            b_q, b_s = quantize_128x128(b) if blocked else quantize_1x128(b)
            block_b = (b_s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k] if blocked
                       else b_s.repeat_interleave(128, 1)[:, :k])
            want = (a_q.float() * a_s.repeat_interleave(128, 1)[:, :k]) @ (b_q.float() * block_b).t()
            candidates = {
                "a outer-major, b.t()": (a_s.t().contiguous().t(), b_s.t() if blocked else b_s.t().contiguous()),
                "a outer-major, b": (a_s.t().contiguous().t(), b_s),
                "a row-major, b.t()": (a_s.contiguous(), b_s.t() if blocked else b_s.t().contiguous()),
                "a outer-major, b outer-major.t()": (a_s.t().contiguous().t(), b_s.t().contiguous().t().t()),
            }
            for name, (sa, sb) in candidates.items():
                try:
                    got = torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).float()
                    err = f"{((got - want).norm() / want.norm()).item():.3g}"
                except (RuntimeError, ValueError) as exc:
                    err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
                print(f"{m}x{n}x{k} B {'128x128' if blocked else '1x128'}: {name:<34} rel err {err}")
            tri = triton_fp8_gemm(a_q, a_s, b_q, b_s, blocked, torch.bfloat16).float()
            print(f"{m}x{n}x{k} B {'128x128' if blocked else '1x128'}: {'triton kernel':<34} rel err "
                  f"{((tri - want).norm() / want.norm()).item():.3g}")
            timings = {"triton": lambda: triton_fp8_gemm(a_q, a_s, b_q, b_s, blocked, torch.bfloat16),
                       "bf16 matmul": lambda a16=a.bfloat16(), b16=b.bfloat16(): a16 @ b16.t()}
            sa, sb = candidates["a outer-major, b.t()"]
            timings["scaled_mm"] = lambda: torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            line = []
            for name, fn in timings.items():
                try:
                    fn()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(20):
                        fn()
                    end.record()
                    end.synchronize()
                    ms = start.elapsed_time(end) / 20
                    line.append(f"{name} {ms:.3f} ms ({2 * m * n * k / ms / 1e9:.0f} TFLOP/s)")
                except RuntimeError as exc:
                    line.append(f"{name} failed ({str(exc).splitlines()[0][:60]})")
            print("   " + ", ".join(line))


if __name__ == "__main__":
    main()
