"""LLM training-step throughput: lf-llm's model and trainer step vs HF transformers' Llama.

Run on a CUDA machine:  uv run python bench/llm_throughput.py [--steps N] [--variant NAME=KEY=VALUE,...]

The case is the one of ``../shared/anchors/hf_llm_throughput.py``: a ~0.5B Llama (8 layers,
hidden 2048, 16 heads / 4 KV heads, FFN 5632, vocab 32000), batch 4 x 4096 tokens, bf16, AdamW,
on one GPU. In one process, on the same GPU, one after the other:

- ``matmul``: a bf16 8192^3 matrix product, the measured peak that MFU is taken against;
- ``hf_sdpa`` / ``hf_sdpa_compile``: ``LlamaForCausalLM`` with SDPA attention (and under
  ``torch.compile``), bf16 weights, fused ``torch.optim.AdamW`` (the anchor's step);
- ``ours``: ``lf-llm train --config train_0_5b``'s model and ``MegatronTrainer.train_step`` (megatron
  DDP, fp32 main weights and grads, AdamW, grad clipping, LR schedule) on random tokens;
  ``--variant`` adds more of ours with config overrides (``train.recompute=selective``) or the
  bench's own knobs (``spec.recompute_elementwise=false``, ``attention_backend=flash|fused|unfused``);
- ``ours_fp8_<mode>`` (``--fp8 blockwise|adaptive``, repeatable): ours with ``fp8=<mode>``, the dense
  layers' GEMMs in blockwise FP8; its tokens/s and memory are compared with ours in bf16, and for
  ``adaptive`` the per-GEMM table it measured (``loongforge.kernels.fp8_linear.adaptive_table``) is printed.

Each run: warm-up steps, then ``--steps`` timed steps; tokens/s, model TFLOP/s (the anchor's FLOP
formula, ``GPTConfig.flops_per_token``), MFU against the measured matmul peak, and peak allocated
memory (``torch.cuda.max_memory_allocated`` since the run started). A table with the ratios of
ours to each baseline comes last, after a torch.profiler table of ours' top GPU kernels.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import warnings

import torch

SHAPE = dict(layers=8, hidden=2048, heads=16, kv_heads=4, ffn=5632, vocab=32000, batch=4, seq=4096)


def model_config():
    from loongforge.llm.model_config import GPTConfig

    s = SHAPE
    return GPTConfig(num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                     num_query_groups=s["kv_heads"], ffn_hidden_size=s["ffn"], vocab_size=s["vocab"],
                     max_position_embeddings=s["seq"])


def timed(step, steps: int, warmup: int) -> float:
    """Median seconds of ``steps`` calls after ``warmup`` calls (synchronised host clock)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def fresh_memory():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    seconds = timed(lambda: a @ b, steps=20, warmup=3)
    del a, b
    return 2 * 8192**3 / seconds


# -- baselines ---------------------------------------------------------------------------------
def hf_step(compile_: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPE
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
                      max_position_embeddings=s["seq"], tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device="cuda")
    forward = torch.compile(model) if compile_ else model

    def step():
        forward(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt)


# -- ours ----------------------------------------------------------------------------------------
def split_overrides(overrides: list[str]) -> tuple[list[str], dict]:
    """Config overrides for ``load_llm_config`` and the bench's own knobs."""
    config, knobs = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key in ("spec.recompute_elementwise", "attention_backend"):
            knobs[key] = value
        else:
            config.append(item)
    return config, knobs


def our_step(overrides: list[str], run_dir: str):
    from megatron.core.transformer.enums import AttnBackend

    from loongforge.core.parallel import init_parallel
    from loongforge.core.training.trainer import MegatronTrainer
    from loongforge.llm.layers.fp8_linear import fp8_linears
    from loongforge.llm.layers.gpt_model import FusedLossGPTModel
    from loongforge.llm.layers.spec import fast_layer_spec
    from loongforge.llm.recipe import LLMTask, load_llm_config

    config_overrides, knobs = split_overrides(overrides)
    cfg = load_llm_config("train_0_5b", [f"log.run_dir={run_dir}", "log.tensorboard=false", "log.progress=false",
                                         "checkpoint.save=false", *config_overrides])
    expected = model_config()
    if cfg.model != expected:
        raise SystemExit(f"train_0_5b's model {cfg.model} differs from the bench shape {expected}")
    s = SHAPE
    if (cfg.train.micro_batch_size, cfg.train.seq_length) != (s["batch"], s["seq"]):
        raise SystemExit(f"train_0_5b's batch is {cfg.train.micro_batch_size} x {cfg.train.seq_length}")

    class BenchTask(LLMTask):
        """The lf-llm task with the bench's knobs applied to the layer spec and TransformerConfig."""

        def transformer_config_kwargs(self):
            kwargs = super().transformer_config_kwargs()
            if "attention_backend" in knobs:
                kwargs["attention_backend"] = AttnBackend[knobs["attention_backend"]]
            return kwargs

        def build_model(self, ctx, transformer_config, pre_process, post_process):
            if "spec.recompute_elementwise" not in knobs:
                return super().build_model(ctx, transformer_config, pre_process, post_process)
            keep = knobs["spec.recompute_elementwise"].lower() in ("1", "true", "yes")
            m = self.cfg.model
            with fp8_linears(self.cfg.fp8):
                spec = fast_layer_spec(m, recompute_elementwise=keep)
            return FusedLossGPTModel(
                config=transformer_config, transformer_layer_spec=spec,
                vocab_size=m.vocab_size, max_sequence_length=m.max_position_embeddings, pre_process=pre_process,
                post_process=post_process, share_embeddings_and_output_weights=m.tie_embeddings,
                position_embedding_type="rope", rotary_percent=m.rotary_percent, rotary_base=int(m.rotary_base),
                pg_collection=ctx.pgs,
            )

    ctx = init_parallel(seed=cfg.train.seed)
    task = BenchTask(cfg)
    trainer = MegatronTrainer(task, ctx, cfg.train, cfg.log, cfg.checkpoint)
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device="cuda")
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
             "position_ids": torch.arange(s["seq"], device="cuda").expand(s["batch"], -1).contiguous()}

    def step():
        trainer.train_step([batch])

    return step, (trainer, task, ctx)


def profile_tables(step, rows: int, trace: str | None) -> str:
    """Two profiled steps of ``step``: the top GPU kernels, and the top torch ops by the GPU time
    of the kernels they launched; ``trace``: also write a Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels) / 2 / 1e3
    lines = [f"GPU kernel time per step: {total:.1f} ms (2 steps profiled); top kernels, ms per step:"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]:
        lines.append(f"{e.self_device_time_total / 2e3:8.2f} {e.count // 2:5d}x  {e.key[:110]}")
    ops = [e for e in events if e.device_type.name == "CPU" and e.key.startswith("aten::") and e.device_time_total]
    lines.append("top torch ops by the GPU time of their kernels, ms per step:")
    for e in sorted(ops, key=lambda e: -e.device_time_total)[:rows]:
        lines.append(f"{e.device_time_total / 2e3:8.2f} {e.count // 2:5d}x  {e.key}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                        help="one more run of ours with these overrides (comma-separated)")
    parser.add_argument("--fp8", action="append", default=[], choices=["blockwise", "adaptive"],
                        help="one more run of ours with fp8=<mode>, compared with ours in bf16")
    parser.add_argument("--skip", action="append", default=[], help="a run to leave out (hf_sdpa, hf_sdpa_compile)")
    parser.add_argument("--profile-rows", type=int, default=25, help="0: no profiler tables")
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps of ours here")
    args = parser.parse_args(argv)
    args.fp8 = list(dict.fromkeys(args.fp8))  # each mode once
    if not torch.cuda.is_available():
        raise SystemExit("bench/llm_throughput.py needs a CUDA GPU")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOONGFORGE_ACCELERATOR", "cuda")

    flops_per_token = model_config().flops_per_token(SHAPE["seq"])
    tokens_per_step = SHAPE["batch"] * SHAPE["seq"]
    peak = matmul_peak()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; measured bf16 matmul "
          f"{peak / 1e12:.0f} TFLOP/s; {flops_per_token / 1e9:.2f} GFLOP/token", flush=True)

    runs = [("ours", [])] + [(n, ()) for n in ("hf_sdpa", "hf_sdpa_compile") if n not in args.skip]
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        runs.insert(1, (name, overrides.split(",") if overrides else []))
    for mode in reversed(args.fp8):
        runs.insert(1, (f"ours_fp8_{mode}", [f"fp8={mode}"]))
    results, profile, measured_table = {}, None, None
    with tempfile.TemporaryDirectory() as run_dir:
        for name, overrides in runs:
            fresh_memory()
            if name.startswith("hf_"):
                step, keep = hf_step(compile_=name.endswith("compile"))
            else:
                if name == "ours_fp8_adaptive":
                    from loongforge.kernels import fp8_linear as fused_fp8

                    fused_fp8.clear_adaptive_table()  # this run's shapes only
                step, keep = our_step(list(overrides), run_dir)
            seconds = timed(step, args.steps, args.warmup)
            if name == "ours_fp8_adaptive":
                measured_table = fused_fp8.adaptive_table()
            memory = torch.cuda.max_memory_allocated() / 2**30
            if name == "ours" and args.profile_rows:
                profile = profile_tables(step, args.profile_rows, args.trace)
            tps = tokens_per_step / seconds
            results[name] = (tps, tps * flops_per_token / 1e12, tps * flops_per_token / peak, memory)
            print(f"{name}: {seconds * 1e3:.1f} ms/step, {tps:,.0f} tokens/s, {memory:.1f} GiB", flush=True)
            del step, keep
            if not name.startswith("hf_"):
                from loongforge.core.parallel import destroy_parallel

                destroy_parallel()
    if profile:
        print("\nours, torch.profiler:\n" + profile)
    print(f"\n{'run':<22}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak GiB':>10}"
          + "".join(f"{'x ' + b:>18}" for b in results if b.startswith("hf_")))
    for name, (tps, tflops, mfu, memory) in results.items():
        ratios = "".join(f"{tps / results[b][0]:>18.2f}" for b in results if b.startswith("hf_"))
        print(f"{name:<22}{tps:>12,.0f}{tflops:>10.0f}{mfu:>8.1%}{memory:>10.1f}{ratios}")
    for mode in args.fp8:
        (tps, *_, memory), (bf16_tps, *_, bf16_memory) = results[f"ours_fp8_{mode}"], results["ours"]
        print(f"fp8={mode} / bf16 (ours): {tps / bf16_tps:.2f}x tokens/s, peak memory {memory:.1f} / {bf16_memory:.1f} GiB")
    if measured_table:
        print("\nfp8=adaptive, the GEMM choices it measured (one line per GEMM of each linear shape):\n" + measured_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
