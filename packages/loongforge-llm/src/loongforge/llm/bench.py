"""``lf-llm bench``: lf-llm's training step against HF transformers' Llama, in one process.

The case is a train config (default ``train_0_5b``: a ~0.5B Llama, 8 layers, hidden 2048, GQA
16/4, FFN 5632, vocab 32000, batch 4 x 4096 tokens). On the accelerator present, one after the
other:

- ``matmul``: a square matrix product in the run's dtype, the measured peak that MFU is taken
  against;
- ``hf_sdpa`` / ``hf_sdpa_compile``: ``LlamaForCausalLM`` of the same architecture with SDPA
  attention (and under ``torch.compile``; CUDA only), weights in the run's dtype, AdamW (fused on
  CUDA), the same micro-batches per step;
- ``ours``: the config's model and ``Trainer.train_step`` (megatron DDP, fp32 main
  weights and grads, AdamW, grad clipping, LR schedule) on random tokens; ``--variant`` adds runs
  with more config overrides (``train.recompute=selective``; commas inside brackets or quotes stay
  in the value) or the bench's own knobs (``spec.recompute_elementwise=false``: the fast layer spec
  with that setting; ``attention_backend=flash|fused|unfused``);
- ``ours_fp8_<mode>`` (``--fp8 blockwise|adaptive``): ours with ``fp8=<mode>``, compared with ours
  in bf16; for ``adaptive`` the run's FP8 plan (measured when its model was built, before the
  timed steps) is printed: per linear shape, the time of each choice of GEMMs in FP8 and the
  choice. ``adaptive`` needs a GPU with the fused FP8 kernels and is refused before any run
  elsewhere.

Each run: warm-up steps, then ``--steps`` timed steps; tokens/s, model TFLOP/s
(``GPTConfig.flops_per_token``), MFU against the measured matmul and peak memory (GPUs). The table
of ratios of ours to each baseline comes last, after a torch.profiler table of ours' top GPU
kernels (CUDA). On CPU (fp32) it is a smoke run of the same code, e.g. ``--config train_debug``.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loongforge.core.benchmarking import (BenchDevice, RunResult, check_timing, parse_variant, profile_tables,
                                          results_table)
from loongforge.core.config import ConfigError
from loongforge.llm.recipe import LLMConfig, load_llm_config

BENCH_KNOBS = ("spec.recompute_elementwise", "attention_backend")
TRUTH = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass
class Run:
    name: str
    cfg: LLMConfig  # the config this run trains with (the base config for the HF baselines)
    knobs: dict  # the bench's own knobs (ours only)

    @property
    def baseline(self) -> bool:
        return self.name.startswith("hf_")


def split_overrides(overrides: list[str]) -> tuple[list[str], dict]:
    """A run's ``key=value`` items: config overrides and the bench's own knobs (checked here)."""
    from megatron.core.transformer.enums import AttnBackend

    config, knobs = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "attention_backend" and value not in AttnBackend.__members__:
            raise ConfigError(f"attention_backend={value!r}: one of {', '.join(AttnBackend.__members__)}")
        if key == "spec.recompute_elementwise":
            if value.lower() not in TRUTH:
                raise ConfigError(f"spec.recompute_elementwise={value!r}: true or false")
            value = TRUTH[value.lower()]
        if key in BENCH_KNOBS:
            knobs[key] = value
        else:
            config.append(item)
    return config, knobs


def micro_batches(cfg: LLMConfig, device) -> list[dict]:
    """One step's micro-batches of random tokens (one process; the same for every run of the bench)."""
    t = cfg.train
    count = t.global_batch_size // t.micro_batch_size
    g = torch.Generator().manual_seed(t.seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_length), generator=g).to(device)
        out.append({"tokens": tokens, "labels": tokens, "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
                    "position_ids": torch.arange(t.seq_length, device=device).expand(t.micro_batch_size, -1).contiguous()})
    return out


def hf_llama_config(cfg: LLMConfig):
    """transformers' ``LlamaConfig`` of the config's (llama-family) model, from the llama family's
    HF adapter (the one ``lf-llm convert lf-to-hf`` writes), with SDPA attention."""
    from transformers import LlamaConfig

    from loongforge.core.hf_mapping import MappingError
    from loongforge.core.models import get_model_spec

    m = cfg.model
    if m.family != "llama":
        raise ConfigError(f"lf-llm bench compares with HF's Llama: model.family={m.family!r} is not 'llama'")
    try:
        hf = LlamaConfig.from_dict(get_model_spec(m.family).hf_adapter.config_to_hf(m))
    except MappingError as exc:
        raise ConfigError(f"lf-llm bench compares with HF's Llama: {exc}") from exc
    hf._attn_implementation = "sdpa"
    return hf


def hf_step(cfg: LLMConfig, dev: BenchDevice, compile_: bool):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_llama_config(cfg)).to(dev.device, dev.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.cuda)
    batches = [b["tokens"] for b in micro_batches(cfg, dev.device)]
    forward = torch.compile(model) if compile_ else model

    def step():
        for tokens in batches:
            forward(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, (model, opt)


def our_step(run: Run):
    from megatron.core.transformer.enums import AttnBackend

    from loongforge.core.parallel import init_parallel
    from loongforge.core.training.loop import Trainer
    from loongforge.llm.recipe import LLMTask

    cfg, knobs = run.cfg, run.knobs

    class BenchTask(LLMTask):
        """The lf-llm task with the bench's knobs applied to the TransformerConfig and the family's build."""

        def transformer_config_kwargs(self):
            kwargs = super().transformer_config_kwargs()
            if "attention_backend" in knobs:
                kwargs["attention_backend"] = AttnBackend[knobs["attention_backend"]]
            return kwargs

        def build_kwargs(self):
            kwargs = super().build_kwargs()
            if "spec.recompute_elementwise" in knobs:
                kwargs["recompute_elementwise"] = knobs["spec.recompute_elementwise"]
            return kwargs

    ctx = init_parallel(seed=cfg.train.seed)
    task = BenchTask(cfg)
    trainer = Trainer(task, ctx, cfg)
    batches = micro_batches(cfg, ctx.accelerator.device())

    def step():
        trainer.train_step(batches)

    return step, (trainer, task, ctx)


def plan_runs(config: str, overrides: list[str], variants: list[str], fp8: list[str], skip: list[str], cuda: bool,
              run_dir: str) -> list[Run]:
    """Every run in order (ours, its FP8 and named variants, the baselines), each config loaded
    and each knob checked here, so that a bad one fails before any run."""
    def ours(name: str, items: list[str]) -> Run:
        config_overrides, knobs = split_overrides([*overrides, *items])
        cfg = load_llm_config(config, [*config_overrides, f"log.run_dir={run_dir}/{name}", "log.tensorboard=false",
                                       "log.progress=false", "checkpoint.save=false",
                                       "checkpoint.resume=false"])
        return Run(name, cfg, knobs)

    runs = [ours("ours", [])]
    runs += [ours(f"ours_fp8_{mode}", [f"fp8={mode}"]) for mode in dict.fromkeys(fp8)]
    if "adaptive" in fp8:  # nothing to time without the fused FP8 kernels
        from loongforge.core.kernels import KernelPolicy
        from loongforge.llm.layers.fp8_measure import check_adaptive_fp8

        adaptive = next(r for r in runs if r.name == "ours_fp8_adaptive")
        check_adaptive_fp8(KernelPolicy(force_reference=adaptive.cfg.kernels.force_reference), key="--fp8")
    for spec in variants:
        runs.append(ours(*parse_variant(spec, [r.name for r in runs])))
    base = runs[0].cfg
    return runs + [Run(n, base, {}) for n in ("hf_sdpa", "hf_sdpa_compile") if n not in skip and (cuda or n == "hf_sdpa")]


def run_bench(config: str = "train_0_5b", overrides: list[str] = (), steps: int = 10, warmup: int = 3,
              variants: list[str] = (), fp8: list[str] = (), skip: list[str] = (), profile_rows: int = 25,
              trace: str | None = None, report: Callable[[str], None] = print) -> dict[str, RunResult]:
    """Every run's tokens/s, TFLOP/s, MFU and peak memory; ``report`` gets each line when known.
    Tokens and FLOPs per step are each run's own (a variant may change the batch or the model)."""
    from loongforge.core.parallel import destroy_parallel

    check_timing(steps, warmup)
    dev = BenchDevice()
    with tempfile.TemporaryDirectory() as run_dir:
        runs = plan_runs(config, list(overrides), list(variants), list(fp8), list(skip), dev.cuda, run_dir)
        hf_llama_config(runs[0].cfg)  # a family the baseline cannot build fails here
        warnings.filterwarnings("ignore")
        peak = dev.matmul_peak()
        t = runs[0].cfg.train
        report(f"device: {dev.describe()}; measured matmul {peak / 1e12:.2f} TFLOP/s; "
               f"{runs[0].cfg.model.flops_per_token(t.seq_length) / 1e9:.3f} GFLOP/token; "
               f"{t.global_batch_size * t.seq_length} tokens/step ({config})")
        if not dev.cuda and "hf_sdpa_compile" not in skip:
            report("hf_sdpa_compile: skipped (the compiled baseline runs on CUDA only)")

        results: dict[str, RunResult] = {}
        profile, fp8_plan = None, None
        for run in runs:
            dev.fresh_memory()
            try:
                if run.baseline:
                    step, keep = hf_step(run.cfg, dev, compile_=run.name.endswith("compile"))
                else:
                    step, keep = our_step(run)
                    if run.name == "ours_fp8_adaptive":
                        fp8_plan = keep[1].fp8_plan  # the task's plan, made when its model was built
                seconds = dev.timed(step, steps, warmup)
                memory = dev.peak_gib()
                if run.name == "ours" and profile_rows and dev.cuda:
                    profile = profile_tables(step, dev, profile_rows, trace)
                del step, keep
            finally:
                if not run.baseline:
                    destroy_parallel()
            t = run.cfg.train
            tokens = t.global_batch_size * t.seq_length
            tps, flops = tokens / seconds, tokens * run.cfg.model.flops_per_token(t.seq_length) / seconds
            results[run.name] = RunResult(tps, flops / 1e12, flops / peak, memory)
            report(f"{run.name}: {seconds * 1e3:.1f} ms/step, {tps:,.0f} tokens/s ({tokens} a step), "
                   f"{memory:.1f} GiB")
    if profile:
        report("\nours, torch.profiler:\n" + profile)
    report("\n" + "\n".join(results_table(results)))
    for mode in dict.fromkeys(fp8):
        a, b = results[f"ours_fp8_{mode}"], results["ours"]
        report(f"fp8={mode} / bf16 (ours): {a.tokens_per_s / b.tokens_per_s:.2f}x tokens/s, "
               f"peak memory {a.peak_gib:.1f} / {b.peak_gib:.1f} GiB")
    if fp8_plan is not None:
        report("\nfp8=adaptive, the run's FP8 plan (one line per linear shape, out x in of its local weight; ms of one "
               "forward+backward with the GEMMs named in FP8, f/d/w = fprop/dgrad/wgrad):\n" + fp8_plan.table())
    return results
