"""Blockwise FP8 vs bf16 GEMMs on Hopper: per-shape ratios, the FP8 linear, fp8=adaptive's choices.

Run on a CUDA machine (sm_90):  uv run python bench/fp8_gemm.py [--shapes 4096x4096x4096,...] [--steps 200]

1. GEMMs, ``[M, K] x [N, K]^T``: bf16 ``torch.mm`` against the FP8 GEMM alone (operands already
   quantised: the Triton kernel and, where it runs, ``torch._scaled_mm`` with blockwise scales)
   and against FP8 including the quantisation of both operands. Ratios are bf16 time / FP8 time.
2. The FP8 linear (forward + backward, fp32 master weight, bf16 activations): ``F.linear`` in bf16
   against ``fp8_linear`` with every GEMM in FP8 and with the GEMMs fp8=adaptive chooses for the
   shape (loongforge-llm's ``layers.fp8_measure``: the registry op timed in each of the 8
   choices, bf16 weight), whose per-shape table is printed afterwards.
3. A short training run of a small MLP regression in bf16 and with FP8 linears, same data and
   initial weights: the final losses and their relative difference.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from loongforge.core.kernels import get_kernel

DEFAULT_SHAPES = (
    "4096x4096x4096,8192x8192x8192,16384x7168x2048,16384x2048x7168,"
    "4096x18432x7168,4096x7168x18432,2048x1536x7168,512x4096x4096"
)


def time_ms(fn, reps: int = 5, warmup: int = 2) -> float:
    """Mean CUDA milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        try:
            m, n, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"fp8_gemm: shape {item!r} is not MxNxK") from None
        out.append((m, n, k))
    return out


def gemm_table(shapes) -> None:
    from loongforge.kernels import fp8_gemm as fg

    print("| M x N x K | bf16 ms | bf16 TFLOP/s | fp8 triton ms | fp8 scaled_mm ms | fp8+quant ms | "
          "bf16/triton | bf16/scaled_mm | bf16/(fp8+quant) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = fg.quantize_1x128(x)
        wq, ws = fg.quantize_128x128(w)
        bf16 = time_ms(lambda: x @ w.t(), reps=10, warmup=3)
        tri = time_ms(lambda: fg.triton_fp8_gemm(xq, xs, wq, ws, True, torch.bfloat16), reps=10, warmup=3)
        try:
            fg.scaled_mm_fp8_gemm(xq, xs, wq, ws, True, torch.bfloat16)
            smm = time_ms(lambda: fg.scaled_mm_fp8_gemm(xq, xs, wq, ws, True, torch.bfloat16), reps=10, warmup=3)
        except (RuntimeError, NotImplementedError) as exc:
            smm = float("nan")
            print(f"(torch._scaled_mm blockwise unavailable: {str(exc).splitlines()[0]})")
        best = tri if smm != smm else min(tri, smm)  # nan-safe
        gemm = fg.scaled_mm_fp8_gemm if best == smm else fg.triton_fp8_gemm
        full = time_ms(
            lambda: gemm(*fg.quantize_1x128(x), *fg.quantize_128x128(w), True, torch.bfloat16), reps=10, warmup=3
        )
        tflops = 2 * m * n * k / bf16 / 1e9
        print(f"| {m}x{n}x{k} | {bf16:.3f} | {tflops:.0f} | {tri:.3f} | {smm:.3f} | {full:.3f} | "
              f"{bf16 / tri:.2f}x | {bf16 / smm:.2f}x | {bf16 / full:.2f}x |", flush=True)


def linear_table(shapes) -> None:
    from loongforge.core.kernels import KernelPolicy
    from loongforge.llm.layers.fp8_measure import measure_fp8_plan, registry_linear_timer

    fp8_linear = get_kernel("fp8_linear")
    timer = registry_linear_timer(KernelPolicy(), torch.bfloat16, torch.device("cuda"), torch.cuda.synchronize)
    plans = []
    print("\n| tokens x out x in | bf16 linear fwd+bwd ms | fp8 ms | adaptive ms | bf16/fp8 | bf16/adaptive |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda") * k**-0.5).requires_grad_()
        w16 = w.detach().to(torch.bfloat16).requires_grad_()
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        bf16 = time_ms(lambda: F.linear(x, w16).backward(dy), reps=5, warmup=3)
        fp8 = time_ms(lambda: fp8_linear(x, w).backward(dy), reps=5, warmup=3)
        plan = measure_fp8_plan([(n, k)], m, timer)  # this shape's choice, measured outside the timing
        gemms = plan.gemms(n, k)
        adaptive = time_ms(lambda: fp8_linear(x, w, gemms=gemms).backward(dy), reps=5, warmup=3)
        plans.append(plan)
        print(f"| {m}x{n}x{k} | {bf16:.3f} | {fp8:.3f} | {adaptive:.3f} | {bf16 / fp8:.2f}x | {bf16 / adaptive:.2f}x |",
              flush=True)
    print("\nfp8=adaptive's choices (ms of the registry op's forward+backward with the GEMMs named in FP8, "
          "f/d/w = fprop/dgrad/wgrad):")
    print("\n".join([plans[0].table().splitlines()[0]] + [p.table().splitlines()[1] for p in plans]), flush=True)


def loss_run(steps: int, width: int = 2048, tokens: int = 4096) -> None:
    fp8_linear = get_kernel("fp8_linear")
    torch.manual_seed(0)
    teacher = [torch.randn(width, width, device="cuda") * width**-0.5 for _ in range(2)]
    init = [torch.randn(width, width, device="cuda") * width**-0.5 for _ in range(3)]
    finals = {}
    for name in ("bf16", "fp8"):
        weights = [w.clone().requires_grad_() for w in init]  # fp32 masters
        opt = torch.optim.AdamW(weights, lr=3e-4)
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(steps):
            x = torch.randn(tokens, width, device="cuda", generator=gen).to(torch.bfloat16)
            with torch.no_grad():
                target = F.gelu(x.float() @ teacher[0]) @ teacher[1]
            h = x
            for i, w in enumerate(weights):
                h = F.linear(h, w.to(torch.bfloat16)) if name == "bf16" else fp8_linear(h, w)
                h = F.gelu(h) if i < len(weights) - 1 else h
            loss = F.mse_loss(h.float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        finals[name] = sum(losses[-10:]) / 10
        print(f"{name}: loss {losses[0]:.4f} -> {finals[name]:.4f} (mean of the last 10 of {steps} steps)")
    print(f"FP8 final loss vs bf16: {100 * (finals['fp8'] - finals['bf16']) / finals['bf16']:+.2f}%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("fp8_gemm: needs an sm_89+ CUDA GPU")
    shapes = _shapes(args.shapes)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    gemm_table(shapes)
    linear_table(shapes)
    loss_run(args.steps)


if __name__ == "__main__":
    main()
