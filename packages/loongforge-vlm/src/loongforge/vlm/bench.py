"""``lf-vlm bench``: lf-vlm's model and trainer step vs transformers' Qwen2.5-VL, in one process.

On a CUDA machine:  lf-vlm bench [--samples N] [--image-size PX] [--text-tokens T]
Smoke run on CPU (tiny parts, fp32, under a minute):  LOONGFORGE_ACCELERATOR=cpu lf-vlm bench --tiny

The model is a Qwen2.5-VL composition of lf-vlm's config groups: by default the real Qwen2.5-VL
vision transformer (``encoder=qwen2_5_vit``: 32 layers, width 1280, window attention), its patch
merger and the ``qwen2_5_0_5b`` foundation (``--tiny``: the ``*_debug`` parts; ``encoder=NAME`` /
``foundation=NAME`` overrides pick other config groups for both sides). A step trains on a fixed batch of ``--samples`` samples, each one
image of ``--image-size`` pixels square between ``--text-tokens`` random text tokens; the loss is
on the text tokens. In one process, on the same device, one after the other:

- ``hf_compile`` (the headline baseline) / ``hf_eager``: ``Qwen2_5_VLForConditionalGeneration``
  (config from ``loongforge.vlm.hf.config_to_hf``) set up as transformers recommends for training
  on a GPU (``hf_recipe``): ``attn_implementation="flash_attention_2"`` where flash-attn is
  installed, else ``"sdpa"``; under ``torch.compile`` (``hf_eager``: the same uncompiled; on CPU
  the compiled one runs only with ``--compile-on-cpu``); weights in the step's dtype; fused
  ``torch.optim.AdamW`` and TF32 on CUDA; on the whole batch at once;
- ``ours``: ``VLMTask``'s model and ``Trainer.train_step`` (megatron DDP, fp32 main
  weights and grads, AdamW, grad clipping) on the same samples, all of them packed into one
  micro-batch as training packs it (``VLMTask.collate``), as transformers gets them in one forward (``--pack K``:
  K per packed micro-batch, ``--pack 1`` one sample each); ``--variant NAME=KEY=VALUE,...`` adds more of ours with config
  overrides (``parallel.encoder.recompute=full``, ``train.recompute=selective``;
  commas inside brackets or quotes stay in the value) or the bench's own knob ``pack=K``.

Both models hold the same weights: the transformers model's random initialisation is saved and
read into ours through the ``vlm`` family's HF mapping, and the positions given to transformers
are the multimodal RoPE positions ours computes, so the first step's losses agree (printed).

The runs alternate order round by round (``--rounds``: the baselines first, then ours first,
...); a run's step time is the median of its timed steps over all rounds. The bench prints the
baseline's settings and checks every run's first-step loss against the headline baseline's
(``FirstLossMismatch`` beyond the precision's tolerance). ``--processes N`` repeats the bench in
N fresh processes and prints each run's median and spread across them.

Each run: warm-up steps, then ``--steps`` timed steps; tokens/s (the foundation's tokens: text and
image tokens), model TFLOP/s (the foundation's FLOPs per token plus the encoder's per patch), MFU
against a measured bf16 matmul peak, and peak allocated memory since the run started. A
torch.profiler table of ours' top kernels comes before the table with the ratios of ours to each
baseline.
"""


from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loongforge.core.baseline_recipe import BaselineRecipe, quiet_transformers_progress, tf32_matmuls
from loongforge.core.bench_protocol import alternating_orders, check_first_losses, timed_steps
from loongforge.core.benchmarking import (BenchDevice, ExtraColumn, RunResult, check_timing, parse_variant,
                                          profile_tables, results_table)
from loongforge.core.config import ConfigError

BASELINES = ("hf_compile", "hf_eager")  # the headline baseline first


def flash_attn_installed() -> bool:
    """Whether the ``flash-attn`` package imports here (transformers' ``flash_attention_2`` needs it)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def hf_recipe(flash_attn: bool | None = None) -> BaselineRecipe:
    """transformers' Qwen2.5-VL as its docs recommend for training on a GPU: FlashAttention-2 when
    flash-attn is installed (else SDPA), ``torch.compile``, fused AdamW, TF32."""
    flash = flash_attn_installed() if flash_attn is None else flash_attn
    return BaselineRecipe(
        project="transformers Qwen2_5_VLForConditionalGeneration",
        source="transformers docs: attn_implementation flash_attention_2 (flash-attn installed) else sdpa, torch.compile",
        options={"attn_implementation": "flash_attention_2" if flash else "sdpa", "compile": True,
                 "fused_adamw": True, "tf32": True},
        cuda_only=frozenset({"fused_adamw", "tf32", "compile"} | ({"attn_implementation"} if flash else set())),
        notes=("hf_eager: the same, uncompiled; on CPU the compiled baseline runs only with --compile-on-cpu",),
    )


# -- the case ----------------------------------------------------------------------------------
@dataclass
class Case:
    """The composition, the batch and the device of every run."""

    config: str  # the config the composition starts from
    overrides: list[str]  # config overrides selecting the parts
    samples: int
    image_size: int
    text_tokens: int
    pack: int
    device: torch.device
    dtype: torch.dtype


def load_config(case: Case, extra: list[str], run_dir: str, seq_length: int):
    from loongforge.vlm.cli import load_vlm_config

    return load_vlm_config(case.config, [
        *case.overrides, f"train.global_batch_size={case.samples}", f"train.seq_length={seq_length}",
        f"train.precision={'bf16' if case.dtype == torch.bfloat16 else 'fp32'}", "train.warmup_steps=0",
        "train.lr=1.0e-5", "train.min_lr=1.0e-5", f"log.run_dir={run_dir}", "log.tensorboard=false",
        "log.progress=false", "checkpoint.save=false", "checkpoint.resume=false", *extra])


@dataclass
class Batch:
    """The step's samples for both models: per-sample arrays (ours) and batched tensors (transformers)."""

    samples: list[dict]  # items of the shape ``VLMDataset`` yields, for ``VLMTask.collate``
    hf_inputs: dict  # keyword arguments of ``Qwen2_5_VLForConditionalGeneration.forward``
    tokens: int  # foundation tokens per step
    patches: int  # vision patches per step


def make_batch(cfg, vision_ids, case: Case) -> Batch:
    """``case.samples`` samples: text, ``<vision_start>`` image tokens ``<vision_end>``, text; labels on text."""
    from loongforge.vlm.positions import VisionItem, mrope_positions

    e = cfg.encoder
    unit = e.patch_size * e.spatial_merge_size
    if case.image_size % unit:
        raise ConfigError(f"--image-size {case.image_size} must be a multiple of patch_size x spatial_merge_size = {unit}")
    grid = (1, case.image_size // e.patch_size, case.image_size // e.patch_size)
    patches = grid[1] * grid[2]
    merge = e.spatial_merge_size
    rng = np.random.default_rng(0)
    special = {vision_ids.image, vision_ids.video, vision_ids.start, vision_ids.end}
    low = min(special)  # text ids below the tokenizer's vision tokens
    samples, text_masks = [], []
    for _ in range(case.samples):
        before = case.text_tokens // 2
        text = rng.integers(0, low, case.text_tokens)
        tokens = np.concatenate([text[:before], [vision_ids.start], np.full(patches // merge**2, vision_ids.image),
                                 [vision_ids.end], text[before:]]).astype(np.int64)
        is_text = ~np.isin(tokens, list(special))
        text_masks.append(is_text)
        positions = mrope_positions(tokens, [VisionItem(grid)], (vision_ids.image, vision_ids.video), merge,
                                    cfg.vision.tokens_per_second)
        pixels = rng.standard_normal((patches, e.patch_dim), dtype=np.float32)
        samples.append(dict(tokens=tokens, labels=np.append(tokens[1:], 0), loss_mask=np.append(is_text[1:], False),
                            position_ids=positions, pixel_values=pixels, grid_thw=np.asarray([grid], dtype=np.int64)))
    device = case.device
    tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples])).to(device)
    text = torch.from_numpy(np.stack(text_masks)).to(device)
    hf_inputs = dict(
        input_ids=tokens,
        labels=torch.where(text, tokens, -100),  # transformers shifts them: the same targets as ours
        position_ids=torch.from_numpy(np.stack([s["position_ids"] for s in samples], axis=1)).to(device),
        pixel_values=torch.from_numpy(np.concatenate([s["pixel_values"] for s in samples])).to(device, case.dtype),
        image_grid_thw=torch.tensor([grid] * case.samples, device=device),
        use_cache=False,
    )
    return Batch(samples, hf_inputs, tokens=tokens.numel(), patches=patches * case.samples)


# -- transformers ------------------------------------------------------------------------------
def save_hf_model(cfg, case: Case, directory: Path) -> None:
    """A randomly initialised ``Qwen2_5_VLForConditionalGeneration`` of the composition, saved
    in the step's dtype: the weights every run starts from."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from loongforge.vlm.hf import config_to_hf

    torch.manual_seed(0)
    with torch.device(case.device):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig.from_dict(config_to_hf(cfg.model())))
    with quiet_transformers_progress():
        model.to(case.dtype).save_pretrained(directory)
    del model


def hf_step(hf_dir: Path, batch: Batch, case: Case, recipe: BaselineRecipe, compile_: bool):
    from transformers import Qwen2_5_VLForConditionalGeneration

    applied = recipe.applied(case.device.type)
    with quiet_transformers_progress():
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            hf_dir, attn_implementation=applied["attn_implementation"] or "sdpa", dtype=case.dtype)
    model.to(case.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=bool(applied["fused_adamw"]))
    forward = torch.compile(model) if compile_ else model

    def step():
        loss = forward(**batch.hf_inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, (model, opt)


# -- ours --------------------------------------------------------------------------------------
def split_overrides(overrides: list[str], default_pack: int) -> tuple[list[str], int]:
    """A variant's config overrides and its samples per micro-batch (the bench's ``pack=K``)."""
    config, pack = [], default_pack
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "pack":
            try:
                pack = int(value)
            except ValueError:
                raise ConfigError(f"bench variant item {item!r}: pack takes a whole number of samples") from None
        else:
            config.append(item)
    return config, pack


def our_step(cfg, hf_dir: Path, batch: Batch, case: Case, pack_size: int):
    from loongforge.core.hf_mapping.online import load_hf_weights
    from loongforge.core.parallel import init_parallel
    from loongforge.core.training.loop import Trainer
    from loongforge.vlm.hf import VLM_HF_ADAPTER
    from loongforge.vlm.recipe import VLMTask

    task = VLMTask(cfg)
    ctx = init_parallel(seed=cfg.train.seed)
    trainer = Trainer(task, ctx, cfg)
    load_hf_weights(trainer.inner_model, hf_dir, VLM_HF_ADAPTER, task.model_cfg)
    trainer.engine.optimizer.reload_model_params()  # the fp32 main weights from the loaded ones
    groups = [batch.samples[i:i + pack_size] for i in range(0, len(batch.samples), pack_size)]
    collate = task.collate(ctx)  # the rows training packs
    micro_batches = [{k: v.to(case.device) if isinstance(v, torch.Tensor) else v for k, v in collate(g).items()}
                     for g in groups]
    def step():
        return trainer.train_step(micro_batches).loss

    return step, (trainer, task, ctx)


# -- the command ---------------------------------------------------------------------------------
def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``lf-vlm bench`` besides the shared ``--config``, ``--steps``, ``--warmup``,
    ``--variant`` and config overrides (``encoder=...``, ``foundation=...`` swap a part; any other
    override applies to both models, e.g. ``encoder.num_layers=8``)."""
    parser.add_argument("--tiny", action="store_true", help="the debug parts (qwen2_5_vit_debug + qwen2_debug)")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (default 8; --tiny: 2)")
    parser.add_argument("--image-size", type=int, default=None, help="image side in pixels (default 448; --tiny: 32)")
    parser.add_argument("--text-tokens", type=int, default=None, help="text tokens per sample (default 768; --tiny: 24)")
    parser.add_argument("--pack", type=int, default=None,
                        help="samples per packed micro-batch of ours (default: all samples of a step in one)")
    parser.add_argument("--skip", action="append", default=[], choices=BASELINES,
                        help="a baseline to leave out (on CPU hf_compile is left out unless --compile-on-cpu)")
    parser.add_argument("--compile-on-cpu", action="store_true")


def make_case(args, dev: BenchDevice, config: str, overrides: list[str]) -> Case:
    samples = args.samples or (2 if args.tiny else 8)
    given = {o.split("=", 1)[0] for o in overrides}
    parts = {"encoder": "qwen2_5_vit_debug" if args.tiny else "qwen2_5_vit",
             "foundation": "qwen2_debug" if args.tiny else "qwen2_5_0_5b"}
    case = Case(
        config=config,
        overrides=[f"{part}={name}" for part, name in parts.items() if part not in given] + list(overrides),
        samples=samples,
        image_size=args.image_size or (32 if args.tiny else 448),
        text_tokens=args.text_tokens if args.text_tokens is not None else (24 if args.tiny else 768),
        pack=args.pack if args.pack is not None else samples,
        device=dev.device, dtype=dev.dtype)
    if case.samples < 1 or case.pack < 1 or case.samples % case.pack:
        raise ConfigError(f"--samples {case.samples} must be a positive multiple of --pack {case.pack}")
    return case


def plan_runs(args, case: Case) -> list[tuple[str, list[str] | None]]:
    """(name, overrides) of every run: the baselines (overrides None), ours, the variants; a
    malformed variant fails here, before any run."""
    skip = set(args.skip) | ({"hf_compile"} if case.device.type == "cpu" and not args.compile_on_cpu else set())
    runs = [(name, None) for name in BASELINES if name not in skip] + [("ours", [])]
    for spec in args.variant:
        name, items = parse_variant(spec, [r[0] for r in runs])
        pack_size = split_overrides(items, case.pack)[1]
        if pack_size < 1 or case.samples % pack_size:
            raise ConfigError(f"--variant {spec!r}: pack={pack_size} must divide the {case.samples} samples")
        runs.append((name, items))
    return runs


@dataclass
class VLMRunResult(RunResult):
    """One run's measurements and its first step's loss (the same weights: the runs' should agree)."""

    first_loss: float
    step_s: float  # median seconds per step


def run_bench(args, config: str = "vlm_debug", overrides: list[str] = (),
              report: Callable[[str], None] = print) -> dict[str, VLMRunResult]:
    """Every run's tokens/s, TFLOP/s, MFU, peak GiB and first-step loss; ``report`` gets each line when known."""
    from loongforge.core.bench_protocol import check_protocol
    from loongforge.vlm.recipe import VLMTask

    check_timing(args.steps, args.warmup)
    check_protocol(args.rounds, args.processes)
    dev = BenchDevice()
    case = make_case(args, dev, config, list(overrides))
    runs = plan_runs(args, case)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as scratch:
        parts = " ".join(case.overrides)
        cfg = load_config(case, [], scratch, seq_length=1)  # a bad composition fails here
        ids = VLMTask(cfg).vision_ids  # the tokenizer's; every config of the runs names them
        case.overrides += [f"vision.image_token_id={ids.image}", f"vision.video_token_id={ids.video}",
                           f"vision.vision_start_token_id={ids.start}", f"vision.vision_end_token_id={ids.end}"]
        batch = make_batch(cfg, ids, case)
        length = batch.tokens // case.samples
        cfg = load_config(case, [], scratch, seq_length=length * case.pack)
        ours_configs = {}  # every run of ours, loaded (and so checked) before any run
        for name, overrides in runs:
            if overrides is not None:
                config_overrides, pack_size = split_overrides(overrides, case.pack)
                ours_configs[name] = (load_config(case, config_overrides, str(Path(scratch) / name),
                                                  seq_length=length * pack_size), pack_size)
        f, e = cfg.foundation, cfg.encoder
        flops_per_step = batch.tokens * f.flops_per_token(length) + batch.patches * e.flops_per_patch()
        counts = cfg.model().parameter_counts()
        peak = dev.matmul_peak()
        report(f"device: {dev.describe()}; {parts} ({', '.join(f'{k} {v / 1e6:.1f}M' for k, v in counts.items())} "
               f"parameters); {case.samples} samples x {length} tokens ({batch.patches // case.samples} patches of a "
               f"{case.image_size}px image each); {flops_per_step / 1e12:.2f} TFLOP/step; measured matmul "
               f"{peak / 1e12:.2f} TFLOP/s")
        hf_dir = Path(scratch) / "hf"
        save_hf_model(cfg, case, hf_dir)

        recipe = hf_recipe()
        for text in recipe.lines(case.device.type):
            report(text)
        configs = dict(runs)
        baselines = [name for name, o in runs if o is None]
        times: dict[str, list[float]] = {name: [] for name, _ in runs}
        peaks: dict[str, float] = {}
        firsts: dict[str, float] = {}
        failed: set[str] = set()
        profile = None
        for i, order in enumerate(alternating_orders(baselines, [n for n, o in runs if o is not None], args.rounds)):
            report(f"round {i + 1} of {args.rounds}: {', '.join(order)}")
            for name in order:
                if name in failed:
                    continue
                overrides = configs[name]
                dev.fresh_memory()
                try:
                    if overrides is None:
                        with tf32_matmuls(bool(recipe.applied(case.device.type)["tf32"])):
                            step, keep = hf_step(hf_dir, batch, case, recipe, compile_=name == "hf_compile")
                            first, seconds = timed_steps(step, args.steps, args.warmup, dev.accel.synchronize)
                    else:
                        run_cfg, pack_size = ours_configs[name]
                        step, keep = our_step(run_cfg, hf_dir, batch, case, pack_size)
                        first, seconds = timed_steps(step, args.steps, args.warmup, dev.accel.synchronize)
                        if name == "ours" and args.profile_rows and profile is None:
                            profile = profile_tables(step, args.profile_rows, args.trace)
                except Exception as error:  # a failing baseline is reported, the others still run
                    if overrides is not None:
                        raise
                    report(f"{name}: failed: {type(error).__name__}: {error}")
                    failed.add(name)
                    continue
                finally:
                    if overrides is not None:
                        from loongforge.core.parallel import destroy_parallel

                        destroy_parallel()
                peaks[name] = max(peaks.get(name, float("-inf")), dev.peak_gib())
                firsts.setdefault(name, first)
                times[name] += seconds
                report(f"  {name}: {statistics.median(seconds) * 1e3:.1f} ms/step, first-step loss {first:.4f}")
                del step, keep

        results = {}
        for name in times:
            if name in failed:
                continue
            seconds = statistics.median(times[name])
            tps, flops = batch.tokens / seconds, flops_per_step / seconds
            results[name] = VLMRunResult(tps, flops / 1e12, flops / peak, peaks[name], firsts[name], seconds)
            report(f"{name}: {seconds * 1e3:.1f} ms/step, {tps:,.0f} tokens/s, peak memory {peaks[name]:.1f} GiB, "
                   f"first-step loss {firsts[name]:.4f}")
    if profile:
        report("\nours, torch.profiler:\n" + profile)
    first_losses = ExtraColumn("loss@1", {name: r.first_loss for name, r in results.items()})
    report("\n" + "\n".join(results_table(results, tokens_decimals=1, extra=[first_losses])))
    reference = next((b for b in BASELINES if b in results), "ours")
    for text in check_first_losses({n: r.first_loss for n, r in results.items()}, reference, case.dtype):
        report(text)
    return results


def step_seconds_from_args(options: dict, config: str, overrides: list[str]) -> dict[str, float]:
    """``run_bench`` with the command's options: each run's seconds per step (one process of ``--processes``)."""
    results = run_bench(argparse.Namespace(**options), config, overrides)
    return {name: r.step_s for name, r in results.items()}
