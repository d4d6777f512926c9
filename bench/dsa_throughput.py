"""DeepSeek-V3.2 sparse attention (DSA) vs dense MLA: training tokens/s and peak memory, 8K to 64K.

Run on a CUDA machine:  uv run python bench/dsa_throughput.py [--seqs 8192,16384,32768,65536]

A reduced DeepSeek-V3.2-shaped model: ``--layers`` pre-norm blocks of MLA attention with the
V3.2 sizes (latent 512, rope 64, nope 128, value 128, indexer 64 heads of 128, top-2048) and
``--heads`` query heads (V3.2 has 128), bf16, one sequence per step. The MLP/MoE of a real
layer is left out: it costs the same in every variant. Each step is a forward and backward of
``mean(out^2)`` (plus the indexer loss for DSA). Variants, all in this process on the same
weights:

- ``dense``: causal MLA through ``torch.nn.functional.scaled_dot_product_attention`` (fused
  flash/efficient/cuDNN kernels, memory linear in the sequence);
- ``dense-unfused``: the same through SDPA's math backend, which materialises the
  ``[heads, S, S]`` scores as unfused attention does (Megatron's local path);
- ``dsa``: the sparse training stage: lightning-indexer top-k, sparse MLA attention over the
  selected keys, and the indexer's KL loss over them (fused Triton kernels where installed).

Out-of-memory is caught and reported per variant. Prints one markdown table and, for DSA,
where its step time goes (``--breakdown-seq``), optionally with a profiler table of one DSA step
(``--profile-seq``).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from loongforge.core.kernels import get_kernel
from loongforge.llm.families.dsa_attention import DSAConfig, DSAttention
from loongforge.llm.ops.dsa import absorb_query

VARIANTS = ("dense", "dense-unfused", "dsa")


class Block(nn.Module):
    def __init__(self, config: DSAConfig):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.attn = DSAttention(config)

    def forward(self, x, mode):
        out, loss = self.attn(get_kernel("rms_norm")(x, self.norm), mode=mode)
        return x + out, loss


class Model(nn.Module):
    def __init__(self, config: DSAConfig, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(config) for _ in range(layers))

    def forward(self, x, mode):
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, loss = block(x, mode)
            if loss is not None:
                aux = aux + loss
        return x.float().square().mean() + aux


# "dense" may use any fused SDPA kernel but never the math fallback (that is "dense-unfused")
FUSED_SDPA = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def _step(model, x, mode):
    model.zero_grad(set_to_none=True)
    x.grad = None
    if mode == "dsa":
        loss = model(x, "sparse")
    else:
        with sdpa_kernel([SDPBackend.MATH] if mode == "dense-unfused" else FUSED_SDPA):
            loss = model(x, "dense")
    loss.backward()


def _timed(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def run_variant(model, config, seq, mode, iters, hidden) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        x = (torch.randn(1, seq, hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
        _step(model, x, mode)  # warm-up (compiles the kernels on first use)
        sec = _timed(lambda: _step(model, x, mode), iters)
        peak = torch.cuda.max_memory_allocated() - base
        return dict(sec=sec, tok_s=seq / sec, peak_gib=peak / 2**30)
    except torch.OutOfMemoryError:
        return dict(oom=True)
    except RuntimeError as exc:  # e.g. no fused SDPA kernel for these head sizes
        return dict(error=str(exc).splitlines()[0][:120])
    finally:
        x = None
        model.zero_grad(set_to_none=True)


def dsa_breakdown(config: DSAConfig, seq: int, iters: int) -> dict[str, float]:
    """Milliseconds of DSA's parts on one layer's inputs (forward + backward where trained)."""
    c = config
    dev, bf = "cuda", torch.bfloat16
    q_idx = torch.randn(1, seq, c.index_n_heads, c.index_head_dim, device=dev, dtype=bf, requires_grad=True)
    k_idx = torch.randn(1, seq, c.index_head_dim, device=dev, dtype=bf, requires_grad=True)
    w_idx = torch.randn(1, seq, c.index_n_heads, device=dev, requires_grad=True)
    d = c.kv_lora_rank + c.qk_rope_head_dim
    q_nope = torch.randn(1, seq, c.num_heads, c.qk_nope_head_dim, device=dev, dtype=bf, requires_grad=True)
    q_rope = torch.randn(1, seq, c.num_heads, c.qk_rope_head_dim, device=dev, dtype=bf, requires_grad=True)
    kv = torch.randn(1, seq, d, device=dev, dtype=bf, requires_grad=True)
    w_uk = (torch.randn(c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank, device=dev) * 0.05).to(bf).requires_grad_()
    w_uv = (torch.randn(c.num_heads, c.v_head_dim, c.kv_lora_rank, device=dev) * 0.05).to(bf).requires_grad_()
    topk, attn, loss_op = (get_kernel(n) for n in ("dsa_indexer_topk", "sparse_mla_absorbed_attention", "dsa_indexer_loss"))
    idx = topk(q_idx, k_idx, w_idx, c.index_topk)
    chunk = 4096  # the indexer loss's target per chunk of queries, as DSAttention runs it

    def attention_fwd():
        with torch.no_grad():
            attn(q_nope, q_rope, kv, idx, w_uk, w_uv, c.softmax_scale)

    def attention():
        attn(q_nope, q_rope, kv, idx, w_uk, w_uv, c.softmax_scale).sum().backward()

    with torch.no_grad():  # the attention's log-sum-exp, which DSAttention hands to the loss
        lse = attn(q_nope, q_rope, kv, idx, w_uk, w_uv, c.softmax_scale, return_lse=True)[1]

    def indexer_loss(with_lse: bool):
        total = 0
        for t0 in range(0, seq, chunk):
            with torch.no_grad():
                q_abs = absorb_query(q_nope[:, t0:t0 + chunk], q_rope[:, t0:t0 + chunk], w_uk)
            total = total + loss_op(q_idx[:, t0:t0 + chunk], k_idx, w_idx[:, t0:t0 + chunk], q_abs, kv.detach(),
                                    c.softmax_scale, idx[:, t0:t0 + chunk],
                                    lse[:, t0:t0 + chunk] if with_lse else None).sum()
        total.backward()

    parts = {}
    for name, fn in (("indexer top-k", lambda: topk(q_idx, k_idx, w_idx, c.index_topk)),
                     ("sparse attention fwd", attention_fwd), ("sparse attention fwd+bwd", attention),
                     ("indexer loss fwd+bwd, target in two passes", lambda: indexer_loss(False)),
                     ("indexer loss fwd+bwd, target in one (the attention's lse; the step's)", lambda: indexer_loss(True))):
        fn()
        parts[name] = 1e3 * _timed(fn, iters)
    return parts


def profile_step(model, config: DSAConfig, seq: int, hidden: int, rows: int) -> None:
    """A torch profiler table of one DSA training step (after a warm-up step), by CUDA time."""
    from torch.profiler import ProfilerActivity, profile

    x = (torch.randn(1, seq, hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    _step(model, x, "dsa")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(model, x, "dsa")
        torch.cuda.synchronize()
    print(f"## profile of one DSA step at {seq} tokens", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="8192,16384,32768,65536")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--breakdown-seq", type=int, default=None,
                        help="where DSA's time goes, part by part, at this length (default: the longest of --seqs; 0: not shown)")
    parser.add_argument("--profile-seq", type=int, default=None, help="print a profiler table of a DSA step here")
    parser.add_argument("--profile-rows", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dsa_throughput: needs a CUDA device")
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"dsa_throughput: unknown variant {v!r}; known: {VARIANTS}")
    config = DSAConfig(hidden_size=args.hidden, num_heads=args.heads, q_lora_rank=min(1536, args.hidden))
    torch.manual_seed(0)
    model = Model(config, args.layers).cuda().to(torch.bfloat16)
    impls = {n: get_kernel(n).__module__ for n in ("sparse_mla_absorbed_attention", "dsa_indexer_topk", "dsa_indexer_loss")}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads, kv latent {config.kv_lora_rank}+{config.qk_rope_head_dim}, indexer "
          f"{config.index_n_heads}x{config.index_head_dim}, top-{config.index_topk}; ops from {impls}", flush=True)
    print("| seq | variant | step ms | tokens/s | peak GiB | tokens/s vs dense |")
    print("|-----|---------|--------:|---------:|---------:|------------------:|", flush=True)
    for seq in (int(s) for s in args.seqs.split(",")):
        results = {}
        for v in variants:
            r = results[v] = run_variant(model, config, seq, v, args.iters, args.hidden)
            if r.get("oom") or r.get("error"):
                print(f"| {seq} | {v} | {'OOM' if r.get('oom') else 'error: ' + r['error']} | - | - | - |", flush=True)
                continue
            dense = results.get("dense", {})
            ratio = f"{r['tok_s'] / dense['tok_s']:.2f}x" if "tok_s" in dense else "-"
            print(f"| {seq} | {v} | {1e3 * r['sec']:.1f} | {r['tok_s']:,.0f} | {r['peak_gib']:.2f} | {ratio} |", flush=True)
    if args.profile_seq:
        try:
            profile_step(model, config, args.profile_seq, args.hidden, args.profile_rows)
        except torch.OutOfMemoryError:
            print(f"DSA profile at {args.profile_seq}: OOM")
    seq = max(int(s) for s in args.seqs.split(",")) if args.breakdown_seq is None else args.breakdown_seq
    if "dsa" in variants and seq > 0:  # where DSA's time goes (by default at the longest sequence; 0: nowhere)
        gc.collect()
        torch.cuda.empty_cache()
        try:
            parts = dsa_breakdown(config, seq, args.iters)
        except torch.OutOfMemoryError:
            print(f"DSA parts at {seq}: OOM")
        else:
            print(f"DSA parts at {seq} (one layer, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)


if __name__ == "__main__":
    main()
