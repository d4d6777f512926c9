"""``lf-llm bench``: lf-llm's training step against HF transformers' model of the same family
(Llama, Qwen2, Qwen3, Mistral), in one process.

The case is a train config (default ``train_0_5b``: a ~0.5B Llama, 8 layers, hidden 2048, GQA
16/4, FFN 5632, vocab 32000, batch 4 x 4096 tokens; the shipped ``bench_*`` configs are the other
cases: ``bench_llama_1b``, ``bench_qwen3_4b``), or a YAML path, with ``key=value`` overrides, model
keys included. Both sides train with the same precision recipe, the config's ``train.precision``:
``bf16`` (mixed: ours keeps megatron's fp32 main weights and gradients, HF its fp32 weights under
``torch.autocast`` to bf16) or ``bf16-pure`` (bf16 weights, gradients and AdamW state on both
sides; HF's model loaded in bf16). On the accelerator present, one after the other:

- ``matmul``: a square matrix product in the run's dtype, the measured peak that MFU is taken
  against;
- ``hf_compile`` (the headline baseline), ``hf_liger`` and ``hf_eager``:
  the family's ``AutoModelForCausalLM`` of the same architecture set up as transformers recommends for training on
  a GPU (``hf_recipe``: FlashAttention-2 where flash-attn is installed, else SDPA; under
  ``torch.compile``; fused AdamW, TF32, gradient clipping at ``train.clip_grad``), in the
  run's precision recipe, on the micro-batches of ours' first step (its tokens, positions and
  masked targets, the loss the per-token mean over the step as ours takes it); ``hf_liger`` is the model with Liger's Triton
  kernels (``apply_liger_kernel_to_<family>``: RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) as
  Liger documents them, on the eager model (with torch 2.11 and liger-kernel 0.8.5 the compiled
  model with all four kernels returns a wrong loss while each kernel alone agrees:
  ``bench/liger_check.py``), in a fresh process of its own (Liger patches transformers' modules for
  the whole process); it is left out, with a line saying so, where liger-kernel is not installed;
  ``hf_eager`` is the uncompiled ``hf_compile``. ``hf_compile`` and ``hf_liger`` run on CUDA only;
- ``ours``: what ``lf-llm train`` runs: ``Trainer.train_step`` of the lf-llm task (megatron DDP,
  AdamW, grad clipping, LR schedule, the config's precision recipe) on the first step of the data
  ``lf-llm train`` trains on (the bundled corpus, or ``data.prefixes``); ``--variant`` adds runs
  with more config overrides (``train.recompute=selective``; commas inside brackets or quotes stay
  in the value) or the bench's own knobs (``spec.recompute_elementwise=false``: the fast layer spec
  with that setting; ``attention_backend=flash|fused|unfused``);
- ``ours_fp8_<mode>`` (``--fp8 blockwise|adaptive``): ours with ``fp8=<mode>``, compared with ours
  in bf16; for ``adaptive`` the run's FP8 plan (measured when its model was built, before the
  timed steps) is printed: per linear shape, the time of each choice of GEMMs in FP8 and the
  choice. ``adaptive`` needs a GPU with the fused FP8 kernels and is refused before any run
  elsewhere.

Every run starts from the same weights: a random HF model saved once in the compute dtype (so
both recipes start from the same values), read by ours through ``model.init_from_hf`` (a variant
that changes the model starts from random weights of its own, its loss not compared); every run's first-step loss must agree with the headline
baseline's (``FirstLossMismatch`` beyond the precision's tolerance). The runs alternate order
round by round (``--rounds``: the baselines first, then ours first, ...;
``core.bench_protocol.run_rounds``), each built afresh in its round; ``--processes N``
repeats the bench in N fresh processes and prints each run's median and spread.

Each run: warm-up steps, then ``--steps`` timed steps (the median over all rounds); tokens/s,
model TFLOP/s (``GPTConfig.flops_per_token``), MFU against the measured matmul and against the
device's spec peak (``loongforge.core.device_peaks``), and peak memory (GPUs). The table
of ratios of ours to each baseline comes last, after a torch.profiler table of ours' top GPU
kernels (CUDA). On CPU (fp32) it is a smoke run of the same code, e.g. ``--config train_debug``.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loongforge.core.baseline_recipe import BaselineRecipe, quiet_transformers_progress
from loongforge.core.bench_protocol import (Measured, Side, bench_world, check_first_losses, check_protocol,
                                            in_fresh_process, run_rounds, training_step)
from loongforge.core.benchmarking import (BenchDevice, ExtraColumn, RunResult, check_timing, parse_variant,
                                          profile_tables, results_table)
from loongforge.core.device_peaks import spec_peak_bf16
from loongforge.core.config import ConfigError
from loongforge.llm.recipe import LLMConfig, LLMTask, load_llm_config

BENCH_KNOBS = ("spec.recompute_elementwise", "attention_backend")
BASELINES = ("hf_compile", "hf_liger", "hf_eager")  # the headline baseline first
# family -> (transformers' causal-LM class, Liger's patch function for it)
HF_CLASSES = {
    "llama": ("LlamaForCausalLM", "apply_liger_kernel_to_llama"),
    "qwen2": ("Qwen2ForCausalLM", "apply_liger_kernel_to_qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3"),
    "mistral": ("MistralForCausalLM", "apply_liger_kernel_to_mistral"),
}
RECIPES = {
    "mixed": "mixed (bf16 compute; fp32 weights, grads and AdamW state: ours megatron's fp32 main weights, HF "
             "fp32 weights under torch.autocast to bf16)",
    "pure": "pure bf16 (bf16 weights, grads and AdamW state on both sides; HF's model loaded in bf16)",
    "fp32": "fp32 on both sides",
}


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def hf_recipe(family: str = "llama", flash_attn: bool | None = None, liger: bool | None = None) -> BaselineRecipe:
    """transformers' model of ``family`` as its docs recommend for training on a GPU, with and without Liger."""
    flash = installed("flash_attn") if flash_attn is None else flash_attn
    liger = installed("liger_kernel") if liger is None else liger
    model_class, liger_patch = HF_CLASSES[family]
    return BaselineRecipe(
        project=f"transformers {model_class}",
        source=f"transformers docs: flash_attention_2 (flash-attn installed) else sdpa, torch.compile; Liger's "
               f"{liger_patch} on the eager model (hf_liger)",
        options={"attn_implementation": "flash_attention_2" if flash else "sdpa", "compile": True,
                 "fused_adamw": True, "tf32": True, "clip_grad": True, "liger_kernel": liger},
        cuda_only=frozenset({"compile", "fused_adamw", "tf32", "liger_kernel"} | ({"attn_implementation"} if flash else set())),
        notes=(("hf_liger: Liger's kernels uncompiled: compiled with all four kernels (torch 2.11, liger-kernel "
                "0.8.5) its loss is wrong, each kernel alone agrees (bench/liger_check.py)",) if liger
               else ("hf_liger: liger-kernel is not installed, the run is left out",)),
    )
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
        knob: str | bool = value
        if key == "spec.recompute_elementwise":
            if value.lower() not in TRUTH:
                raise ConfigError(f"spec.recompute_elementwise={value!r}: true or false")
            knob = TRUTH[value.lower()]
        if key in BENCH_KNOBS:
            knobs[key] = knob
        else:
            config.append(item)
    return config, knobs


def first_step(cfg: LLMConfig, ctx) -> list[dict]:
    """The micro-batches of the first step ``lf-llm train`` takes with ``cfg`` (its data: the
    bundled corpus or ``data.prefixes``, its seed, batch and sequence length), on the device."""
    task = LLMTask(cfg)
    task.prepare(ctx)
    return next(iter(task.steps(ctx, 0))).micro_batches


def hf_labels(batches: list[dict]) -> tuple[list[torch.Tensor], int]:
    """Per micro-batch, the targets transformers' causal-LM loss takes as ``shift_labels`` (ours'
    labels where ``loss_mask`` is set, -100 elsewhere), and the number of those targets over the
    step (``num_items_in_batch``: the sum of each micro-batch's loss is then the step's per-token
    mean, as ours reduces it)."""
    labels = [torch.where(b["loss_mask"] > 0, b["labels"], -100) for b in batches]
    return labels, sum(int((b["loss_mask"] > 0).sum()) for b in batches)


def hf_config(cfg: LLMConfig):
    """transformers' config of the config's model, from its family's HF adapter (the one
    ``lf-llm convert lf-to-hf`` writes), with SDPA attention."""
    from transformers import AutoConfig

    from loongforge.core.hf_mapping import MappingError
    from loongforge.core.models import get_model_spec

    m = cfg.model
    if m.family not in HF_CLASSES:
        raise ConfigError(f"lf-llm bench compares with transformers' model of the family: model.family={m.family!r} "
                          f"is not one of {', '.join(HF_CLASSES)}")
    try:
        fields = get_model_spec(m.family).hf_adapter.config_to_hf(m)
    except MappingError as exc:
        raise ConfigError(f"lf-llm bench compares with transformers' {HF_CLASSES[m.family][0]}: {exc}") from exc
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf._attn_implementation = "sdpa"
    return hf


def save_hf_model(cfg: LLMConfig, directory: str, dtype: torch.dtype) -> None:
    """A random HF model of the config's model (seed ``train.seed``), saved in ``dtype``: the
    weights every run starts from."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.train.seed)
    with quiet_transformers_progress():
        AutoModelForCausalLM.from_config(hf_config(cfg)).to(dtype).save_pretrained(directory)


def compute_dtype(cfg: LLMConfig, device: torch.device) -> torch.dtype:
    """The compute dtype of a run of ``cfg`` on ``device`` (``train.precision``)."""
    from loongforge.core.training.engine import resolve_dtype

    return resolve_dtype(cfg.train.precision, device)


def run_precision(cfg: LLMConfig, device: torch.device) -> str:
    """The precision recipe of a run of ``cfg`` on ``device``: mixed, pure or fp32."""
    from loongforge.core.training.engine import precision_recipe

    return precision_recipe(cfg.train.precision, device)


def hf_step(cfg: LLMConfig, hf_dir: str, device: torch.device, batches: list[dict], recipe: BaselineRecipe,
            compile_: bool, liger: bool = False):
    """A transformers training step per ``recipe`` on ``batches`` (the micro-batches of ours' first
    step: its tokens, positions and masked next-token targets; the step's loss the per-token mean
    over all of them, as gradient accumulation with ``num_items_in_batch`` gives it), in ``cfg``'s
    precision recipe: bf16 weights (pure), or fp32 weights with the forward under ``torch.autocast``
    to bf16 (mixed, as transformers' Trainer runs with ``bf16=True``). Returns the step and a
    release (nothing outlives the run)."""
    import contextlib
    import importlib

    from transformers import AutoModelForCausalLM

    applied = recipe.applied(device.type)
    mixed = run_precision(cfg, device) == "mixed"
    dtype = compute_dtype(cfg, device)
    with quiet_transformers_progress():
        model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation=applied["attn_implementation"] or "sdpa",
                                                     dtype=torch.float32 if mixed else dtype).to(device)
    if liger:
        patch = getattr(importlib.import_module("liger_kernel.transformers"), HF_CLASSES[cfg.model.family][1])
        patch(model=model)
    model.train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=bool(applied["fused_adamw"]))
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    labels, count = hf_labels(batches)
    items = torch.tensor(count, device=device)
    forward = torch.compile(model) if compile_ else model
    clip = cfg.train.clip_grad if applied["clip_grad"] else 0

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if mixed else contextlib.nullcontext()

    def step():
        total = 0.0
        for batch, targets in zip(batches, labels):
            with autocast():
                loss = forward(input_ids=batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                               shift_labels=targets, num_items_in_batch=items).loss
            loss.backward()
            total = total + loss.detach()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step, lambda: None


def hf_liger_run(config: str, overrides: list[str], hf_dir: str, batches: list[dict], steps: int, warmup: int) -> dict:
    """``hf_liger`` in this (fresh) process on ``batches`` (host tensors): its first-step loss, step
    times, last loss and peak GiB."""
    from dataclasses import asdict

    from loongforge.core.bench_protocol import measure_side

    cfg = load_llm_config(config, overrides)
    recipe = hf_recipe(cfg.model.family)
    device = BenchDevice().device
    side = Side("hf_liger", lambda: hf_step(cfg, hf_dir, device, batches, recipe, compile_=False, liger=True),
                tf32=bool(recipe.applied(device.type)["tf32"]))
    return asdict(measure_side(side, steps, warmup))


def bench_task(cfg: LLMConfig, knobs: dict) -> LLMTask:
    """The lf-llm task of ``cfg`` with the bench's knobs applied to its TransformerConfig and its
    family's build (no knob: ``LLMTask`` itself, the task ``lf-llm train`` trains)."""
    if not knobs:
        return LLMTask(cfg)
    from megatron.core.transformer.enums import AttnBackend

    class BenchTask(LLMTask):
        """The lf-llm task with the bench's knobs."""

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

    return BenchTask(cfg)


def our_step(run: Run):
    """Ours: ``Trainer.train_step`` of the run's task on the first step ``lf-llm train`` takes with
    its config (``training_step``), in the process groups ``lf-llm train`` makes (a world of one,
    the caller's to destroy). Returns the step and the task."""
    from loongforge.core.parallel import init_parallel

    ctx = init_parallel(seed=run.cfg.train.seed)
    task = bench_task(run.cfg, run.knobs)
    step, _ = training_step(task, ctx, run.cfg)
    return step, task


def plan_runs(config: str, overrides: list[str], variants: list[str], fp8: list[str], skip: list[str], cuda: bool,
              run_dir: str) -> list[Run]:
    """Every run in order (ours, its FP8 and named variants, the baselines), each config loaded
    and each knob checked here, so that a bad one fails before any run."""
    requested = load_llm_config(config, split_overrides(list(overrides))[0]).model

    def ours(name: str, items: list[str]) -> Run:
        config_overrides, knobs = split_overrides([*overrides, *items])
        run = [f"log.run_dir={run_dir}/{name}", "log.tensorboard=false", "log.progress=false",
               "checkpoint.save=false", "checkpoint.resume=false"]
        if any(is_model_key(item) for item in items):  # its own model: its own random weights
            return Run(name, load_llm_config(config, [*config_overrides, *run]), knobs)
        # the model is the HF directory's (written from the config's model, model overrides included)
        kept = [item for item in config_overrides if not is_model_key(item)]
        cfg = load_llm_config(config, [f"model.init_from_hf={run_dir}/hf", *kept, *run])
        lost = {k: v for k, v in requested.architecture().items() if cfg.model.architecture().get(k) != v}
        if lost:
            raise ConfigError(f"lf-llm bench starts every run from an HF checkpoint of the model, which does not keep "
                              f"{', '.join(f'model.{k}={v!r}' for k, v in lost.items())}")
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
    liger = installed("liger_kernel")
    wanted = [n for n in BASELINES if n not in skip and (cuda or n == "hf_eager") and (liger or n != "hf_liger")]
    return [Run(n, base, {}) for n in wanted] + runs


def is_model_key(item: str) -> bool:
    """Whether a ``key=value`` override sets the model (the ``model`` group or a ``model.*`` key)."""
    key = item.partition("=")[0].strip().lstrip("+~")
    return key == "model" or key.startswith("model.")


def same_step(a: LLMConfig, b: LLMConfig) -> bool:
    """Whether two runs train the same model on the same micro-batches (their first losses compare)."""
    ta, tb = a.train, b.train
    return (a.model == b.model and (ta.global_batch_size, ta.micro_batch_size, ta.seq_length, ta.seed)
            == (tb.global_batch_size, tb.micro_batch_size, tb.seq_length, tb.seed))


def run_bench(config: str = "train_0_5b", overrides: Sequence[str] = (), steps: int = 10, warmup: int = 3,
              variants: Sequence[str] = (), fp8: Sequence[str] = (), skip: Sequence[str] = (), profile_rows: int = 25,
              trace: str | None = None, rounds: int = 2, report: Callable[[str], None] = print,
              seconds_out: dict[str, float] | None = None) -> dict[str, RunResult]:
    """Every run's tokens/s, TFLOP/s, MFU and peak memory; ``report`` gets each line when known.
    Tokens and FLOPs per step are each run's own (a variant may change the batch or the model; its
    first-step loss is then not compared). ``seconds_out``: also gets each run's median seconds per step."""
    from loongforge.core.bench_protocol import free_device_memory
    from loongforge.core.parallel import destroy_parallel

    check_timing(steps, warmup)
    check_protocol(rounds, 1)
    dev = BenchDevice()
    with tempfile.TemporaryDirectory() as run_dir:
        # the configs name the HF directory: its config.json first, the weights once every run is checked
        hf_config(load_llm_config(config, split_overrides(list(overrides))[0])).save_pretrained(f"{run_dir}/hf")
        runs = plan_runs(config, list(overrides), list(variants), list(fp8), list(skip), dev.cuda, run_dir)
        base = next(r for r in runs if r.name == "ours").cfg
        warnings.filterwarnings("ignore")
        peak = dev.matmul_peak()
        spec = spec_peak_bf16(torch.cuda.get_device_name()) if dev.cuda else None
        t = base.train
        report(f"device: {dev.describe()}; measured matmul {peak / 1e12:.2f} TFLOP/s; spec peak "
               f"{f'{spec / 1e12:.0f} TFLOP/s (dense bf16)' if spec else 'not listed for this device'}; "
               f"{base.model.flops_per_token(t.seq_length) / 1e9:.3f} GFLOP/token; "
               f"{t.global_batch_size * t.seq_length} tokens/step ({config})")
        recipe = hf_recipe(base.model.family)
        report(f"precision recipe: {RECIPES[run_precision(base, dev.device)]} (train.precision={t.precision})")
        for text in recipe.lines(dev.device.type):
            report(text)
        if not dev.cuda:
            report("hf_compile, hf_liger: skipped (they run on CUDA only)")
        save_hf_model(base, f"{run_dir}/hf", compute_dtype(base, dev.device))
        with bench_world(base.train.seed) as ctx:  # the baselines train on ours' first step
            hf_batches = [{k: v.cpu() for k, v in b.items()} for b in first_step(base, ctx)]
        tf32 = bool(recipe.applied(dev.device.type)["tf32"])

        fp8_plans = {}  # the FP8 plan of ours_fp8_adaptive, made when its model was built

        def ours_start(run: Run):
            def start():  # a world of its own: megatron pins a world's models to one attention backend
                step, task = our_step(run)
                if run.name == "ours_fp8_adaptive":
                    fp8_plans[run.name] = task.fp8_plan
                return step, destroy_parallel
            return start

        def hf_start(run: Run):
            return lambda: hf_step(run.cfg, f"{run_dir}/hf", dev.device, hf_batches, recipe,
                                   compile_=run.name == "hf_compile")

        def liger_measure(steps: int, warmup: int) -> Measured:  # Liger patches transformers for the whole process
            return Measured(**in_fresh_process(hf_liger_run, dict(config=config, overrides=list(overrides),
                                                                  hf_dir=f"{run_dir}/hf", batches=hf_batches,
                                                                  steps=steps, warmup=warmup)))

        sides = [Side(r.name, measure=liger_measure) if r.name == "hf_liger"
                 else Side(r.name, hf_start(r), tf32=tf32) if r.baseline else Side(r.name, ours_start(r))
                 for r in runs]
        timed = run_rounds(sides, [r.name for r in runs if r.baseline], rounds, steps, warmup, report)
        firsts = {name: t.first_loss for name, t in timed.items()}
        peaks = {name: t.peak_gib for name, t in timed.items()}
        profile = None
        if profile_rows and dev.cuda:
            step, _ = our_step(next(r for r in runs if r.name == "ours"))
            try:
                step()  # compiled and warm
                profile = profile_tables(step, profile_rows, trace)
            finally:
                del step
                destroy_parallel()
                free_device_memory(dev.accel)
        fp8_plan = fp8_plans.get("ours_fp8_adaptive")

        results: dict[str, RunResult] = {}
        for run in runs:
            seconds = timed[run.name].step_s
            t = run.cfg.train
            tokens = t.global_batch_size * t.seq_length
            tps, flops = tokens / seconds, tokens * run.cfg.model.flops_per_token(t.seq_length) / seconds
            results[run.name] = RunResult(tps, flops / 1e12, flops / peak, peaks[run.name])
            if seconds_out is not None:
                seconds_out[run.name] = seconds
            report(f"{run.name}: {seconds * 1e3:.1f} ms/step, {tps:,.0f} tokens/s ({tokens} a step), "
                   f"{peaks[run.name]:.1f} GiB, first-step loss {firsts[run.name]:.5f}")
    if profile:
        report("\nours, torch.profiler:\n" + profile)
    extra = [ExtraColumn("MFU spec", {n: (r.tflops * 1e12 / spec if spec else float("nan")) for n, r in results.items()},
                         spec=".1%"),
             ExtraColumn("loss@1", firsts, width=10)]
    report("\n" + "\n".join(results_table(results, extra=extra)))
    for mode in dict.fromkeys(fp8):
        a, b = results[f"ours_fp8_{mode}"], results["ours"]
        report(f"fp8={mode} / bf16 (ours): {a.tokens_per_s / b.tokens_per_s:.2f}x tokens/s, "
               f"peak memory {a.peak_gib:.1f} / {b.peak_gib:.1f} GiB")
    if fp8_plan is not None:
        report("\nfp8=adaptive, the run's FP8 plan (one line per linear shape, out x in of its local weight; ms of one "
               "forward+backward with the GEMMs named in FP8, f/d/w = fprop/dgrad/wgrad):\n" + fp8_plan.table())
    reference = runs[0].name  # the headline baseline (ours where every baseline is skipped)
    compared = {r.name: firsts[r.name] for r in runs if same_step(r.cfg, base)}
    for r in runs:
        if r.name not in compared:
            report(f"first-step loss {r.name}: not compared (another model or batch than ours)")
    for text in check_first_losses(compared, reference, compute_dtype(base, dev.device), fp8_runs=[f"ours_fp8_{m}" for m in fp8]):
        report(text)
    return results


def step_seconds(**kwargs) -> dict[str, float]:
    """``run_bench``'s median seconds per step of each run (one process of ``--processes``)."""
    out: dict[str, float] = {}
    run_bench(**kwargs, seconds_out=out)
    return out
