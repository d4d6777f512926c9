"""The LM loss head alone: loongforge-kernels' fused linear cross-entropy against Liger's, forward +
backward of a summed loss (what a token-mean loss hands the op), on one GPU.

Run on a CUDA machine:  python bench/linear_ce_bench.py [--tokens 8192] [--hidden 2048] [--vocab 128256]

For each chunk budget of ours (``--budgets``, MiB of logits per chunk) and for Liger's
``LigerFusedLinearCrossEntropyLoss`` (reduction ``sum``, where liger-kernel is installed) it prints
the median milliseconds of forward + backward over ``--iters`` calls, the peak memory each call adds
on top of its inputs, and the largest difference of its loss and gradients from the unfused torch
reference (logits in fp32, ``F.cross_entropy``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import torch
import torch.nn.functional as F


def timed(fn, iters: int) -> tuple[float, float]:
    """Median ms of ``fn()`` and the peak GiB it allocated above what was allocated before it."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--budgets", default="128,256,512,1024", help="ours' chunk budgets, MiB of logits")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    from loongforge.kernels.linear_cross_entropy import linear_cross_entropy, token_chunk

    torch.manual_seed(0)
    n, h, v = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[-1] = -100

    def reference():
        loss = F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100, reduction="sum")
        return loss, *torch.autograd.grad(loss, (hidden, weight))

    ref = reference()
    print(f"linear cross-entropy: {n} tokens, hidden {h}, vocab {v}, bf16, {torch.cuda.get_device_name()}")

    def report(name, loss_and_grads):
        def call():
            loss = loss_and_grads()
            return loss, *torch.autograd.grad(loss, (hidden, weight))

        ms, gib = timed(call, args.iters)
        out = call()
        diffs = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(out, ref)]
        print(f"{name:<28}{ms:8.2f} ms {gib:8.2f} GiB   max rel diff loss {diffs[0]:.1e}, dhidden {diffs[1]:.1e}, "
              f"dweight {diffs[2]:.1e}")

    for mib in (int(b) for b in args.budgets.split(",")):
        chunk = token_chunk(n, v, 2, mib * 2**20)
        report(f"ours {mib} MiB ({chunk} tokens)",
               lambda mib=mib: linear_cross_entropy(hidden, weight, labels, -100, chunk_bytes=mib * 2**20).sum())
    if importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        report("liger (reduction=sum)", lambda: liger(weight, hidden, labels))
    else:
        print("liger: liger-kernel is not installed, left out")


if __name__ == "__main__":
    main()
