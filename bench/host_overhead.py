"""Host time of one forward call of the LLM layer's pieces, at the 1B bench shape (2 x 4096 tokens,
hidden 2048), with the GPU kept busy so that no launch waits for it: what the host spends per call
where ours' forward is bound by the host (the trace shows the GPU idle at each layer's first linear,
``bench/trace_gaps.py``).

Run on a CUDA machine:  uv run python bench/host_overhead.py [--calls 200]

Prints microseconds per call, with autograd recording and without: ``F.linear`` and
``torch.matmul`` (what transformers' linears run), ``MainGradLinear`` (ours'), a tensor allocation,
an elementwise add, and the kernel registry's fused Triton ops the layer launches (RMSNorm, SwiGLU).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from loongforge.core.kernels import get_kernel
from loongforge.llm.layers.main_grad_linear import MainGradLinear

TOKENS, BATCH, HIDDEN, QKV, FFN = 4096, 2, 2048, 3072, 8192


def host_us(fn, calls: int) -> float:
    """Mean host microseconds of ``calls`` calls of ``fn``, queued behind about a second of GPU work."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(TOKENS, BATCH, HIDDEN, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(QKV, HIDDEN, device=dev, dtype=dt, requires_grad=True)
    norm_w = torch.ones(HIDDEN, device=dev, dtype=dt, requires_grad=True)
    gate_up = torch.randn(TOKENS, BATCH, 2 * FFN, device=dev, dtype=dt, requires_grad=True)
    rms_norm, swiglu = get_kernel("rms_norm"), get_kernel("swiglu")
    cases = {
        "F.linear": lambda: F.linear(x, w),
        "torch.matmul(x, w.t())": lambda: torch.matmul(x, w.t()),
        "MainGradLinear": lambda: MainGradLinear.apply(x, w, None, None),
        "torch.empty (48 MiB)": lambda: torch.empty(TOKENS, BATCH, QKV, device=dev, dtype=dt),
        "x + x": lambda: x + x,
        "rms_norm (registry)": lambda: rms_norm(x, norm_w),
        "swiglu (registry)": lambda: swiglu(gate_up),
    }
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call ({args.calls} calls); "
          f"rms_norm from {rms_norm.__module__}, swiglu from {swiglu.__module__}")
    print("| call | no grad | grad |")
    print("|---|---:|---:|")
    for name, fn in cases.items():
        with torch.no_grad():
            plain = host_us(fn, args.calls)
        print(f"| {name} | {plain:.1f} | {host_us(fn, args.calls):.1f} |", flush=True)


if __name__ == "__main__":
    main()
