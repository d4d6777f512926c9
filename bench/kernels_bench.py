"""Fused Triton kernels vs their torch reference (eager and torch.compile), forward + backward.

Run on a CUDA machine:  uv run python bench/kernels_bench.py [--iters 20] [--ops rms_norm,rope]

For each op of the kernel registry (``loongforge.core.kernels``: core's ops and those
loongforge-llm and loongforge-diffusion define) it times one forward + backward of the fused version
(from the installed ``loongforge-kernels`` wheel, found through its entry point), of the torch
reference, and of ``torch.compile`` of the reference (for ``qk_norm_rope`` and
``modulated_layer_norm``, whose backwards are ops of their own, the reference is what they
replace composed under autograd: RMSNorm then RoPE, LayerNorm then the transform), all
in this process on the same inputs, and prints the time ratios (reference / fused), the peak
memory each one adds on top of its inputs, and the largest difference of the fused outputs and
gradients from the reference.
Default shapes are LLM-sized: 16384 tokens, hidden 2048, vocab 32000, 16 heads of 128, bf16.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Case:
    """One op at one shape: its inputs (leaves) and the gradients fed to its outputs."""

    op: str
    shape: str
    inputs: list[torch.Tensor]
    out_grads: list[torch.Tensor]
    # for ops whose backward is a registry op of its own: the differentiable function over the
    # fused pair, and the autograd composition it replaces
    build: Callable | None = None
    composed: Callable | None = None


def _cases(args, device) -> list[Case]:
    dt = getattr(torch, args.dtype)
    n, h, v, heads, hd, ffn = args.tokens, args.hidden, args.vocab, args.heads, args.head_dim, args.ffn

    def leaf(*shape, dtype=dt, scale=1.0, grad=True):
        return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)

    def grad_like(*shape, dtype=dt):
        return torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)

    positions = torch.arange(n, device=device) % 4096  # packed sequences of up to 4096 tokens
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
    emb = torch.cat([positions[:, None] * inv_freq[None, :]] * 2, dim=-1)
    labels = torch.randint(0, v, (n,), device=device)
    labels[torch.rand(n, device=device) < 0.1] = -100  # some ignored (padding/prompt) tokens
    pair_angles = positions[:, None] * inv_freq[None, :]

    cos, sin = pair_angles.cos(), pair_angles.sin()

    def normed_rotated(kernels) -> Callable:
        from loongforge.diffusion.ops.attention_inputs import normed_rotated_qkv

        return lambda qkv, wq, wk: normed_rotated_qkv(qkv, wq, wk, cos, sin, 1e-6, kernels)

    def layer_norm_then_transform(kernels) -> Callable:
        from loongforge.diffusion.ops.modulated_norm import normalize_and_modulate

        return lambda x, weight, bias: normalize_and_modulate(x, weight, bias, 1e-6, kernels)

    def rms_norm_then_rope(qkv, wq, wk):
        """The ops the fused function replaces, under autograd: the registry's reference RMSNorm,
        then the interleaved rotation of channel pairs."""
        from loongforge.core.kernels.reference import rms_norm

        width = wq.shape[0]
        out = []
        for i, w in enumerate((wq, wk)):
            y = rms_norm(qkv[:, i * width : (i + 1) * width], w, 1e-6).float()
            a, b = y.unflatten(1, (-1, hd // 2, 2)).unbind(-1)
            c, s = cos[:, None], sin[:, None]
            out.append(torch.stack((a * c - b * s, a * s + b * c), -1).flatten(1).to(qkv.dtype))
        return out[0], out[1], qkv[:, 2 * width :]

    return [
        Case("rms_norm", f"x [{n}, {h}]", [leaf(n, h), leaf(h)], [grad_like(n, h)]),
        Case("add_rms_norm", f"x, residual [{n}, {h}]", [leaf(n, h), leaf(n, h), leaf(h)], [grad_like(n, h), grad_like(n, h)]),
        Case(
            "rope",
            f"x [{n}, {heads}, {hd}], cos/sin [{n}, {hd}] fp32",
            [leaf(n, heads, hd), emb.cos(), emb.sin()],
            [grad_like(n, heads, hd)],
        ),
        Case(
            "qk_norm_rope",
            f"qkv [{n}, 3x{heads * hd}], q/k RMSNorm + interleaved RoPE (forward and backward ops)",
            [leaf(n, 3 * heads * hd), leaf(heads * hd, dtype=torch.float32), leaf(heads * hd, dtype=torch.float32)],
            [grad_like(n, heads * hd) for _ in range(3)],
            build=normed_rotated,
            composed=rms_norm_then_rope,
        ),
        Case(
            "modulated_layer_norm",
            f"x [{n}, {h}], adaLN 1 + scale / shift [1, {h}] fp32 (forward and backward ops)",
            [leaf(n, h), (1 + leaf(1, h, dtype=torch.float32, grad=False) * 0.1).requires_grad_(),
             leaf(1, h, dtype=torch.float32)],
            [grad_like(n, h)],
            build=layer_norm_then_transform,
            composed=lambda x, weight, bias: (F.layer_norm(x.float(), (x.shape[1],), eps=1e-6) * weight + bias).to(x.dtype),
        ),
        Case("swiglu", f"gate_up [{n}, 2x{ffn}]", [leaf(n, 2 * ffn)], [grad_like(n, ffn)]),
        Case(
            "linear_cross_entropy",
            f"hidden [{n}, {h}], weight [{v}, {h}]",
            [leaf(n, h), leaf(v, h, scale=h**-0.5), labels],
            [torch.rand(n, device=device)],  # per-token loss weights
        ),
    ]


def _step(fn: Callable, case: Case):
    for t in case.inputs:
        t.grad = None
    out = fn(*case.inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, case.out_grads)
    return outs


def _measure(fn: Callable, case: Case, iters: int, warmup: int) -> tuple[float, int]:
    """Milliseconds per forward + backward, and peak bytes allocated above the inputs."""
    for _ in range(warmup):
        _step(fn, case)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        _step(fn, case)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    for t in case.inputs:
        t.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(fn, case)
    torch.cuda.synchronize()
    return ms, torch.cuda.max_memory_allocated() - base


def _max_diff(fused: Callable, ref: Callable, case: Case) -> float:
    """Largest |fused - reference| over the outputs and the input gradients (in fp32)."""
    got = [o.detach().float() for o in _step(fused, case)]
    got += [t.grad.float() for t in case.inputs if t.grad is not None]
    want = [o.detach().float() for o in _step(ref, case)]
    want += [t.grad.float() for t in case.inputs if t.grad is not None]
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=8192, help="SwiGLU intermediate size (default 4 x hidden)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ops", default="", help="comma-separated subset of ops (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("kernels_bench: no CUDA device on this machine; the fused Triton kernels are timed on a CUDA GPU only. Nothing to do.")
        return 0

    from tqdm import tqdm

    from loongforge.core.kernels import OpWithBackward, installed_kernels, installed_ops

    fused_ops, ops = installed_kernels(), installed_ops()
    if not fused_ops:
        print("kernels_bench: no fused kernels are installed (install the loongforge-kernels wheel)", file=sys.stderr)
        return 1
    wanted = [o for o in args.ops.split(",") if o] or list(ops)
    unknown = sorted(set(wanted) - set(ops))
    if unknown:
        print(f"kernels_bench: unknown op(s) {unknown} in --ops; known: {sorted(ops)}", file=sys.stderr)
        return 2

    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  iters: {args.iters}  torch {torch.__version__}")
    rows = []
    for case in tqdm([c for c in _cases(args, device) if c.op in wanted], desc="kernels", unit="op"):
        if case.op not in fused_ops:
            rows.append((case.op, case.shape, None))
            continue
        if case.build is None:
            ref, fused = ops[case.op].reference, fused_ops[case.op].fn
        else:
            ref, fused = case.composed, case.build(OpWithBackward(fused_ops[case.op].fn, fused_ops[f"{case.op}_backward"].fn))
        impls = {"fused": fused, "reference": ref}
        if not args.no_compile:
            torch._dynamo.reset()
            impls["compiled"] = torch.compile(ref)
        diff = _max_diff(fused, ref, case)
        results = {name: _measure(fn, case, args.iters, args.warmup) for name, fn in impls.items()}
        rows.append((case.op, case.shape, (results, diff)))
        gc.collect()
        torch.cuda.empty_cache()

    mib = 1 << 20
    header = f"{'op':<22}{'fused ms':>10}{'ref ms':>10}{'ref/fused':>10}{'comp ms':>10}{'comp/fused':>11}"
    header += f"{'fused MiB':>11}{'ref MiB':>10}{'comp MiB':>10}{'max|diff|':>11}  shape"
    print(header)
    for op, shape, res in rows:
        if res is None:
            print(f"{op:<22}{'(no fused kernel installed)':>40}  {shape}")
            continue
        results, diff = res
        f_ms, f_mem = results["fused"]
        r_ms, r_mem = results["reference"]
        c_ms, c_mem = results.get("compiled", (float("nan"), 0))
        line = f"{op:<22}{f_ms:>10.3f}{r_ms:>10.3f}{r_ms / f_ms:>10.2f}{c_ms:>10.3f}{c_ms / f_ms:>11.2f}"
        line += f"{f_mem / mib:>11.0f}{r_mem / mib:>10.0f}{c_mem / mib:>10.0f}{diff:>11.2e}  {shape}"
        print(line)
    print("ratios > 1: the fused kernel is faster; MiB: peak memory allocated above the inputs during forward + backward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
