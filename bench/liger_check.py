"""Does Liger's patched Llama give transformers' loss here? One variant per fresh process (Liger
patches transformers' modules for the whole process): the first-step loss and gradient norm of a
2-layer Llama (the ``train_0_5b`` widths, bf16, one 4096-token sequence) plain, with each of
Liger's kernels alone and with all of them eager, and plain and all under ``torch.compile``.

``lf-llm bench``'s ``hf_liger_compile`` baseline is only as honest as this table: a kernel whose
loss differs from the plain model's is not a faster baseline, it is a broken one.

Run on a CUDA machine:  python bench/liger_check.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

KERNELS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")
VARIANTS = ("plain", *KERNELS, "all")


def one(variant: str, compile_: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().train()
    if variant != "plain":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        flags = {k: variant in (k, "all") for k in KERNELS}
        apply_liger_kernel_to_llama(model=model, cross_entropy=False, **flags)
    tokens = torch.randint(0, cfg.vocab_size, (1, 4096), generator=torch.Generator().manual_seed(1)).cuda()
    forward = torch.compile(model) if compile_ else model
    loss = forward(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grad = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    return {"variant": variant, "compile": compile_, "loss": loss.item(), "grad_norm": grad.item()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.compile)))
        return 0
    print(f"{'variant':28s} {'compile':8s} {'loss':>10s} {'grad norm':>11s}  vs plain", flush=True)
    plain = {}
    for compile_ in (False, True):
        for variant in (VARIANTS if not compile_ else ("plain", "all")):
            cmd = [sys.executable, __file__, "--one", variant] + (["--compile"] if compile_ else [])
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            if done.returncode:
                print(f"{variant} compile={compile_}: failed\n{done.stderr[-1500:]}", flush=True)
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            base = plain.setdefault(compile_, r)
            diff = f"{r['loss'] - base['loss']:+.4f} / {r['grad_norm'] / base['grad_norm']:.4f}x"
            print(f"{variant:28s} {str(compile_):8s} {r['loss']:10.4f} {r['grad_norm']:11.4f}  {diff}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
