"""``lf-vlm bench``: lf-vlm's model and trainer step vs transformers' model of the same layout
(Qwen2.5-VL, Qwen3-VL), in one process.

On a CUDA machine:  lf-vlm bench [--case NAME] [--samples N] [--image-size PX | --image-sizes HxW,...]
                    [--text-tokens T | --seq-tokens L] [train.precision=bf16-pure]
Smoke run on CPU (tiny parts, fp32, under a minute):  LOONGFORGE_ACCELERATOR=cpu lf-vlm bench --tiny

The model is a composition of lf-vlm's config groups: by default the real Qwen2.5-VL vision
transformer (``encoder=qwen2_5_vit``: 32 layers, width 1280, window attention), its patch merger
and the ``qwen2_5_0_5b`` foundation (``--tiny``: the ``*_debug`` parts; ``encoder=NAME`` /
``foundation=NAME`` overrides pick other config groups for both sides). ``--case NAME`` runs a
shipped case (``CASES``): ``qwen2_5_vl_3b`` (Qwen2.5-VL-3B's shape, config
``bench_qwen2_5_vl_3b``: pure bf16, fits an 80 GB GPU) and ``qwen3_vl_8b`` (Qwen3-VL-8B's,
``bench_qwen3_vl_8b``: pure bf16, an H200), each 4 samples of 2048 tokens with images of four
sizes. A step trains on a fixed batch of ``--samples`` samples, each one image (the sizes of
``--image-sizes`` cycle over the samples) between random text tokens (``--text-tokens`` of them,
or as many as fill the sample to ``--seq-tokens``: every sample has one length, as transformers
takes them in one batch); the loss is on the text tokens. In one process, on the same device:

- ``hf_compile`` (the headline baseline) / ``hf_eager``: the HF class of the composition's layout
  (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``; config from
  ``loongforge.vlm.hf.config_to_hf``) set up as transformers recommends for training on a GPU
  (``hf_recipe``): ``attn_implementation="flash_attention_2"`` where flash-attn is installed, else
  ``"sdpa"``; under ``torch.compile`` (``hf_eager``: the same uncompiled; on CPU the compiled one
  runs only with ``--compile-on-cpu``); fused ``torch.optim.AdamW`` and TF32 on CUDA; on the whole
  batch at once, in ours' precision recipe (``train.precision``: mixed, fp32 weights under bf16
  autocast; ``bf16-pure``, bf16 weights, gradients and AdamW state); a baseline that fails is
  reported and left out;
- ``ours``: what ``lf-vlm train`` runs, ``Trainer.train_step`` of the lf-vlm task (megatron DDP,
  the precision recipe, AdamW, grad clipping) on the same samples, all of them packed into one
  micro-batch as training packs it (``VLMTask.collate``), as transformers gets them in one forward
  (``--pack K``: K per packed micro-batch, ``--pack 1`` one sample each); ``--variant
  NAME=KEY=VALUE,...`` adds more of ours with config overrides (``parallel.encoder.recompute=full``,
  ``train.recompute=selective``; commas inside brackets or quotes stay in the value) or the bench's
  own knob ``pack=K``.

Both models hold the same weights: the transformers model's random initialisation is saved and
read into ours through the ``vlm`` family's HF mapping, and the positions given to transformers
are the multimodal RoPE positions ours computes, so the first step's losses agree (printed).

The runs alternate order round by round (``--rounds``: the baselines first, then ours first,
...; ``core.bench_protocol.run_rounds``), each built afresh in its round; a run's step time is
the median of its timed steps over all rounds. The bench prints the baseline's settings and checks
every run's first-step loss against the headline baseline's (``FirstLossMismatch`` beyond the
precision's tolerance). ``--processes N`` repeats the bench in N fresh processes and prints each
run's median and spread across them.

Each run: warm-up steps, then ``--steps`` timed steps; tokens/s (the foundation's tokens: text and
image tokens), model TFLOP/s (the foundation's FLOPs per token plus the encoder's per patch), MFU
against a measured bf16 matmul peak, and peak allocated memory. A torch.profiler table of ours'
top kernels comes before the table with the ratios of ours to each baseline.
"""


from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loongforge.core.baseline_recipe import BaselineRecipe, quiet_transformers_progress
from loongforge.core.bench_protocol import Side, check_first_losses, run_rounds, training_step
from loongforge.core.benchmarking import (BenchDevice, ExtraColumn, RunResult, check_timing, parse_variant,
                                          profile_tables, results_table)
from loongforge.core.config import ConfigError

BASELINES = ("hf_compile", "hf_eager")  # the headline baseline first
DEFAULT_CONFIG = "vlm_debug"  # lf-vlm's default config: the bench swaps its parts for real ones


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
@dataclass(frozen=True)
class ShippedCase:
    """A shipped bench case (``--case NAME``): the config of its composition and its batch, each
    sample one image (the sizes cycle over the samples) and text filling the sample to
    ``seq_tokens`` tokens."""

    config: str
    samples: int
    image_sizes: tuple[tuple[int, int], ...]  # (height, width) in pixels
    seq_tokens: int


CASES = {
    # Qwen2.5-VL-3B's shape: 4 samples x 2048 tokens, images of four sizes (multiples of 28 px)
    "qwen2_5_vl_3b": ShippedCase("bench_qwen2_5_vl_3b", 4, ((448, 448), (672, 448), (336, 504), (896, 672)), 2048),
    # Qwen3-VL-8B's shape: 4 samples x 2048 tokens, images of four sizes (multiples of 32 px)
    "qwen3_vl_8b": ShippedCase("bench_qwen3_vl_8b", 4, ((512, 512), (768, 512), (384, 576), (1024, 768)), 2048),
}


@dataclass
class Case:
    """The composition, the batch and the device of every run."""

    config: str  # the config the composition starts from
    overrides: list[str]  # config overrides selecting the parts
    samples: int
    image_sizes: list[tuple[int, int]]  # (height, width) of each sample's image, cycled over the samples
    text_tokens: int | None  # text tokens per sample; None: what fills the sample to seq_tokens
    seq_tokens: int | None  # tokens per sample (with text_tokens None)
    pack: int
    device: torch.device


def load_config(case: Case, extra: list[str], run_dir: str, seq_length: int):
    from loongforge.vlm.run_config import load_vlm_config

    return load_vlm_config(case.config, [
        *case.overrides, f"train.global_batch_size={case.samples}", f"train.seq_length={seq_length}",
        "train.warmup_steps=0", "train.lr=1.0e-5", "train.min_lr=1.0e-5", f"log.run_dir={run_dir}",
        "log.tensorboard=false", "log.progress=false", "checkpoint.save=false", "checkpoint.resume=false", *extra])


def precision(cfg, device: torch.device) -> tuple[str, torch.dtype]:
    """The run's precision recipe (mixed, pure or fp32: ``train.precision``) and its compute dtype."""
    from loongforge.core.training.engine import precision_recipe, resolve_dtype

    return precision_recipe(cfg.train.precision, device), resolve_dtype(cfg.train.precision, device)


@dataclass
class Batch:
    """The step's samples for both models: per-sample arrays (ours) and batched tensors (transformers)."""

    samples: list[dict]  # items of the shape ``VLMDataset`` yields, for ``VLMTask.collate``
    hf_inputs: dict  # keyword arguments of the HF model's ``forward`` (pixel values in fp32)
    tokens: int  # foundation tokens per step
    patches: int  # vision patches per step
    length: int  # tokens per sample


def make_batch(cfg, vision_ids, case: Case) -> Batch:
    """``case.samples`` samples, each text, ``<vision_start>`` image tokens ``<vision_end>``, text
    (labels on text), the image sizes cycling; every sample the same length (transformers takes
    them as one batch)."""
    from loongforge.vlm.positions import VisionItem, mrope_positions

    e = cfg.encoder
    unit = e.patch_size * e.spatial_merge_size
    for h, w in case.image_sizes:
        if h % unit or w % unit or h < unit or w < unit:
            raise ConfigError(f"image {h}x{w}: each side a positive multiple of patch_size x spatial_merge_size = {unit}")
    merge = e.spatial_merge_size
    rng = np.random.default_rng(0)
    special = {vision_ids.image, vision_ids.video, vision_ids.start, vision_ids.end}
    low = min(special)  # text ids below the tokenizer's vision tokens
    samples, text_masks, grids = [], [], []
    for i in range(case.samples):
        h, w = case.image_sizes[i % len(case.image_sizes)]
        grid = (1, h // e.patch_size, w // e.patch_size)
        patches = grid[1] * grid[2]
        image_tokens = patches // merge**2
        if case.seq_tokens is not None:
            text_tokens = case.seq_tokens - image_tokens - 2
        else:
            assert case.text_tokens is not None  # make_case sets one of the two
            text_tokens = case.text_tokens
        if text_tokens < 2:
            raise ConfigError(f"--seq-tokens {case.seq_tokens}: a {h}x{w} image takes {image_tokens + 2} tokens, "
                              f"leaving {text_tokens} for text (at least 2)")
        before = text_tokens // 2
        text = rng.integers(0, low, text_tokens)
        tokens = np.concatenate([text[:before], [vision_ids.start], np.full(image_tokens, vision_ids.image),
                                 [vision_ids.end], text[before:]]).astype(np.int64)
        is_text = ~np.isin(tokens, list(special))
        text_masks.append(is_text)
        positions = mrope_positions(tokens, [VisionItem(grid)], (vision_ids.image, vision_ids.video), merge,
                                    cfg.vision.tokens_per_second)
        pixels = rng.standard_normal((patches, e.patch_dim), dtype=np.float32)
        grids.append(grid)
        samples.append(dict(tokens=tokens, labels=np.append(tokens[1:], 0), loss_mask=np.append(is_text[1:], False),
                            position_ids=positions, pixel_values=pixels, grid_thw=np.asarray([grid], dtype=np.int64)))
    lengths = {len(s["tokens"]) for s in samples}
    if len(lengths) > 1:
        raise ConfigError(f"images of {len(case.image_sizes)} sizes with --text-tokens: the samples' lengths differ "
                          f"({sorted(lengths)}); give --seq-tokens (the text fills each sample to it)")
    device = case.device
    tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples])).to(device)
    text = torch.from_numpy(np.stack(text_masks)).to(device)
    hf_inputs = dict(
        input_ids=tokens,
        labels=torch.where(text, tokens, -100),  # transformers shifts them: the same targets as ours
        position_ids=torch.from_numpy(np.stack([s["position_ids"] for s in samples], axis=1)).to(device),
        pixel_values=torch.from_numpy(np.concatenate([s["pixel_values"] for s in samples])).to(device),
        image_grid_thw=torch.tensor(grids, device=device),
        use_cache=False,
    )
    patches = sum(g[1] * g[2] for g in grids)
    return Batch(samples, hf_inputs, tokens=tokens.numel(), patches=patches, length=lengths.pop())


# -- transformers ------------------------------------------------------------------------------
def hf_model_class(cfg):
    """transformers' class of the composition's HF layout (``Qwen2_5_VLForConditionalGeneration``,
    ``Qwen3VLForConditionalGeneration``, ...)."""
    import transformers

    from loongforge.vlm.hf import layout_of

    return getattr(transformers, layout_of(cfg.model()).architecture)


def save_hf_model(cfg, directory: Path, dtype: torch.dtype, device: torch.device) -> None:
    """A randomly initialised HF model of the composition (its layout's class, config from
    ``loongforge.vlm.hf.config_to_hf``), saved in ``dtype``: the weights every run starts from."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from loongforge.vlm.hf import config_to_hf

    fields = config_to_hf(cfg.model())
    hf_cfg = CONFIG_MAPPING[fields["model_type"]].from_dict(fields)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: seconds, not minutes, for billions of weights
        model = hf_model_class(cfg)(hf_cfg)
    with quiet_transformers_progress():
        model.to(dtype).save_pretrained(directory)
    del model


def hf_step(cfg, hf_dir: Path, batch: Batch, device: torch.device, recipe: BaselineRecipe, compile_: bool):
    """A transformers training step per ``recipe`` on the whole batch, in ``cfg``'s precision
    recipe: bf16 weights and inputs (pure), or fp32 weights with the forward under
    ``torch.autocast`` to bf16 (mixed, as transformers' Trainer runs with ``bf16=True``)."""
    import contextlib

    applied = recipe.applied(device.type)
    recipe_name, dtype = precision(cfg, device)
    mixed = recipe_name == "mixed"
    with quiet_transformers_progress():
        model = hf_model_class(cfg).from_pretrained(
            hf_dir, attn_implementation=applied["attn_implementation"] or "sdpa",
            dtype=torch.float32 if mixed else dtype)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=bool(applied["fused_adamw"]))
    forward = torch.compile(model) if compile_ else model
    inputs = dict(batch.hf_inputs, pixel_values=batch.hf_inputs["pixel_values"].to(torch.float32 if mixed else dtype))

    def autocast():
        return torch.autocast(device.type, dtype=dtype) if mixed else contextlib.nullcontext()

    def step():
        with autocast():
            loss = forward(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, lambda: None


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


def our_step(cfg, hf_dir: Path | None = None, samples: list[dict] | None = None, pack_size: int = 1):
    """Ours: ``Trainer.train_step`` of the lf-vlm task (``training_step``) in the process groups
    ``lf-vlm train`` makes (a world of one, the caller's to destroy), from the weights in
    ``hf_dir`` (read through the ``vlm`` family's HF mapping; None: the task's own initialisation)
    on ``samples`` packed ``pack_size`` to a micro-batch as training packs them
    (``VLMTask.collate``; None: the first step ``lf-vlm train`` takes). Returns the step."""
    from loongforge.core.hf_mapping.online import load_hf_weights
    from loongforge.core.parallel import init_parallel
    from loongforge.vlm.run_config import make_task
    from loongforge.vlm.family import VLM_SPEC

    ctx = init_parallel(seed=cfg.train.seed)
    task = make_task(cfg)
    micro_batches = None
    if samples is not None:
        collate = task.collate(ctx)  # the rows training packs
        micro_batches = [{k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v
                          for k, v in collate(samples[i:i + pack_size]).items()}
                         for i in range(0, len(samples), pack_size)]
    step, trainer = training_step(task, ctx, cfg, micro_batches)
    if hf_dir is not None:
        load_hf_weights(trainer.inner_model, hf_dir, VLM_SPEC.hf_adapter, task.model_cfg)
        trainer.engine.optimizer.reload_model_params()  # the fp32 main weights from the loaded ones
    return step


# -- the command ---------------------------------------------------------------------------------
def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``--image-sizes HxW,HxW,...`` (or ``S`` for a square) -> [(H, W), ...]."""
    sizes = []
    for item in text.split(","):
        h, _, w = item.strip().lower().partition("x")
        try:
            sizes.append((int(h), int(w or h)))
        except ValueError:
            raise ConfigError(f"--image-sizes {text!r}: sizes are HxW pixels (or S for a square), comma-separated") from None
    return sizes


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``lf-vlm bench`` besides the shared ``--config``, ``--steps``, ``--warmup``,
    ``--variant`` and config overrides (``encoder=...``, ``foundation=...`` swap a part; any other
    override applies to both models, e.g. ``encoder.num_layers=8``, ``train.precision=bf16-pure``)."""
    parser.add_argument("--case", choices=sorted(CASES), default=None,
                        help="a shipped case: its config and batch (images of mixed sizes, samples of one length)")
    parser.add_argument("--tiny", action="store_true", help="the debug parts (qwen2_5_vit_debug + qwen2_debug)")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (default 8; --tiny: 2)")
    parser.add_argument("--image-size", type=int, default=None, help="image side in pixels (default 448; --tiny: 32)")
    parser.add_argument("--image-sizes", default=None, metavar="HxW,...",
                        help="images of these sizes, cycled over the samples (with --seq-tokens where they differ)")
    parser.add_argument("--text-tokens", type=int, default=None, help="text tokens per sample (default 768; --tiny: 24)")
    parser.add_argument("--seq-tokens", type=int, default=None,
                        help="tokens per sample: the text fills each sample to this length")
    parser.add_argument("--pack", type=int, default=None,
                        help="samples per packed micro-batch of ours (default: all samples of a step in one)")
    parser.add_argument("--skip", action="append", default=[], choices=BASELINES,
                        help="a baseline to leave out (on CPU hf_compile is left out unless --compile-on-cpu)")
    parser.add_argument("--compile-on-cpu", action="store_true")


def make_case(args, device: torch.device, config: str, overrides: list[str]) -> Case:
    shipped = CASES.get(args.case)
    if shipped is not None and config not in (None, DEFAULT_CONFIG):
        raise ConfigError(f"--case {args.case} --config {config}: the case names its config (give one of them)")
    given = {o.split("=", 1)[0] for o in overrides}
    # the default config's parts swapped for real ones (or the debug ones, --tiny); a case's or another config's stay
    parts = {} if shipped or config != DEFAULT_CONFIG else {"encoder": "qwen2_5_vit_debug" if args.tiny else "qwen2_5_vit",
                                "foundation": "qwen2_debug" if args.tiny else "qwen2_5_0_5b"}
    samples = args.samples or (shipped.samples if shipped else 2 if args.tiny else 8)
    if args.image_sizes:
        sizes = parse_sizes(args.image_sizes)
    elif args.image_size:
        sizes = [(args.image_size, args.image_size)]
    else:
        sizes = list(shipped.image_sizes) if shipped else [(32, 32)] if args.tiny else [(448, 448)]
    seq_tokens = args.seq_tokens if args.seq_tokens is not None else shipped.seq_tokens if shipped and \
        args.text_tokens is None else None
    text_tokens = None if seq_tokens is not None else (
        args.text_tokens if args.text_tokens is not None else (24 if args.tiny else 768))
    case = Case(
        config=shipped.config if shipped else config,
        overrides=[f"{part}={name}" for part, name in parts.items() if part not in given] + list(overrides),
        samples=samples, image_sizes=sizes, text_tokens=text_tokens, seq_tokens=seq_tokens,
        pack=args.pack if args.pack is not None else samples, device=device)
    if case.samples < 1 or case.pack < 1 or case.samples % case.pack:
        raise ConfigError(f"--samples {case.samples} must be a positive multiple of --pack {case.pack}")
    return case


def plan_runs(args, case: Case) -> list[tuple[str, list[str] | None]]:
    """(name, overrides) of every run: the baselines (overrides None), ours, the variants; a
    malformed variant fails here, before any run."""
    skip = set(args.skip) | ({"hf_compile"} if case.device.type == "cpu" and not args.compile_on_cpu else set())
    runs: list[tuple[str, list[str] | None]] = [(name, None) for name in BASELINES if name not in skip]
    runs.append(("ours", []))
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


def size_text(sizes: list[tuple[int, int]]) -> str:
    return ", ".join(f"{h}x{w}" for h, w in sizes)


def run_bench(args, config: str = DEFAULT_CONFIG, overrides: Sequence[str] = (),
              report: Callable[[str], None] = print) -> dict[str, VLMRunResult]:
    """Every run's tokens/s, TFLOP/s, MFU, peak GiB and first-step loss; ``report`` gets each line when known."""
    from loongforge.core.bench_protocol import check_protocol, free_device_memory
    from loongforge.core.parallel import destroy_parallel
    from loongforge.vlm.recipe import VLMTask

    check_timing(args.steps, args.warmup)
    check_protocol(args.rounds, args.processes)
    dev = BenchDevice()
    case = make_case(args, dev.device, config, list(overrides))
    runs = plan_runs(args, case)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as scratch:
        parts = " ".join(case.overrides)
        cfg = load_config(case, [], scratch, seq_length=1)  # a bad composition fails here
        ids = VLMTask(cfg).vision_ids  # the tokenizer's; every config of the runs names them
        case.overrides += [f"vision.image_token_id={ids.image}", f"vision.video_token_id={ids.video}",
                           f"vision.vision_start_token_id={ids.start}", f"vision.vision_end_token_id={ids.end}"]
        batch = make_batch(cfg, ids, case)
        length = batch.length
        cfg = load_config(case, [], scratch, seq_length=length * case.pack)
        recipe_name, dtype = precision(cfg, case.device)
        ours_configs = {}  # every run of ours, loaded (and so checked) before any run
        for name, run_overrides in runs:
            if run_overrides is not None:
                config_overrides, pack_size = split_overrides(run_overrides, case.pack)
                run_cfg = load_config(case, config_overrides, str(Path(scratch) / name), seq_length=length * pack_size)
                if precision(run_cfg, case.device) != (recipe_name, dtype):
                    raise ConfigError(f"--variant {name}: train.precision must be ours' (the first-step losses are "
                                      f"compared)")
                ours_configs[name] = (run_cfg, pack_size)
        f, e = cfg.foundation, cfg.encoder
        flops_per_step = batch.tokens * f.flops_per_token(length) + batch.patches * e.flops_per_patch()
        counts = cfg.model().parameter_counts()
        peak = dev.matmul_peak()
        report(f"device: {dev.describe()}; {args.case or parts or case.config} ({', '.join(f'{k} {v / 1e6:.1f}M' for k, v in counts.items())} "
               f"parameters); {case.samples} samples x {length} tokens ({batch.patches} patches of images "
               f"{size_text(case.image_sizes)}); {flops_per_step / 1e12:.2f} TFLOP/step; measured matmul "
               f"{peak / 1e12:.2f} TFLOP/s; precision recipe {recipe_name} (train.precision={cfg.train.precision})")
        hf_dir = Path(scratch) / "hf"
        save_hf_model(cfg, hf_dir, dtype, case.device)
        recipe = hf_recipe()
        for text in recipe.lines(case.device.type):
            report(text)

        def hf_start(name: str):
            return lambda: hf_step(cfg, hf_dir, batch, case.device, recipe, compile_=name == "hf_compile")

        def ours_start(name: str):
            run_cfg, pack_size = ours_configs[name]

            def start():  # a world of its own, as each lf-vlm train run
                return our_step(run_cfg, hf_dir, batch.samples, pack_size), destroy_parallel
            return start

        tf32 = bool(recipe.applied(case.device.type)["tf32"])
        sides = [Side(name, hf_start(name), tf32=tf32, may_fail=True) if o is None else Side(name, ours_start(name))
                 for name, o in runs]
        timed = run_rounds(sides, [name for name, o in runs if o is None], args.rounds, args.steps, args.warmup, report)
        profile = None
        if args.profile_rows and dev.cuda:
            step = ours_start("ours")()[0]
            try:
                step()  # compiled and warm
                profile = profile_tables(step, args.profile_rows, args.trace)
            finally:
                del step
                destroy_parallel()
                free_device_memory(dev.accel)

        results = {}
        for name, t in timed.items():
            seconds = t.step_s
            tps, flops = batch.tokens / seconds, flops_per_step / seconds
            results[name] = VLMRunResult(tps, flops / 1e12, flops / peak, t.peak_gib, t.first_loss, seconds)
            report(f"{name}: {seconds * 1e3:.1f} ms/step, {tps:,.0f} tokens/s, peak memory {t.peak_gib:.1f} GiB, "
                   f"first-step loss {t.first_loss:.4f}")
    if profile:
        report("\nours, torch.profiler:\n" + profile)
    first_losses = ExtraColumn("loss@1", {name: r.first_loss for name, r in results.items()})
    report("\n" + "\n".join(results_table(results, tokens_decimals=1, extra=[first_losses])))
    reference = next((b for b in BASELINES if b in results), "ours")
    for text in check_first_losses({n: r.first_loss for n, r in results.items()}, reference, dtype):
        report(text)
    return results


def step_seconds_from_args(options: dict, config: str, overrides: list[str]) -> dict[str, float]:
    """``run_bench`` with the command's options: each run's seconds per step (one process of ``--processes``)."""
    results = run_bench(argparse.Namespace(**options), config, overrides)
    return {name: r.step_s for name, r in results.items()}
