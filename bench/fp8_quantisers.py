"""The blockwise FP8 quantisers alone at an LLM linear's activation shapes, on a CUDA machine.

Run:  python bench/fp8_quantisers.py [--shapes 8192x2048,8192x8192]

For each ``[tokens, features]`` bf16 activation: ``quantize_1x128`` and ``quantize_1x128_transposed``
one after the other (two reads of it) against ``quantize_1x128_both`` (one read); microseconds per call
and GB/s of the bytes each moves at least (bf16 read once, every e4m3 copy written), with a bitwise
check that both ways give the same numbers.
"""

from __future__ import annotations

import argparse

import torch


def _us(fn, iters: int = 50) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    from loongforge.kernels import fp8_gemm as fg

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x2048,8192x3072,8192x8192,8192x16384,2048x16384")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}; us per call (GB/s of bf16 read once + e4m3 copies written)")
    print("| shape | separate (two reads) | both (one read) |")
    print("|---|---:|---:|")
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        both = fg.quantize_1x128_both(x)
        apart = (*fg.quantize_1x128(x), *fg.quantize_1x128_transposed(x))
        same = all(torch.equal(a.view(torch.uint8) if a.dtype == fg.FP8_DTYPE else a,
                               b.view(torch.uint8) if b.dtype == fg.FP8_DTYPE else b) for a, b in zip(both, apart))
        moved = rows * cols * 4  # bf16 in, two e4m3 copies out
        times = (_us(lambda: (fg.quantize_1x128(x), fg.quantize_1x128_transposed(x))),
                 _us(lambda: fg.quantize_1x128_both(x)))
        cells = " | ".join(f"{t:.1f} ({moved / t / 1e3:.0f})" for t in times)
        print(f"| {rows}x{cols} | {cells} |{'' if same else ' MISMATCH'}")


if __name__ == "__main__":
    main()
