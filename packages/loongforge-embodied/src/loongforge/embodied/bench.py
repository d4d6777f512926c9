"""``lf-embodied bench``: training-step throughput (samples/s) of a policy, and of LeRobot's own
Pi0.5 for the same config, batch and image size, in the same process.

Ours is what ``lf-embodied train`` runs: ``Trainer.train_step`` of the policy task on the torch
engine built from the config (its precision, compilation, recomputation, fused AdamW, clipping),
on the first step of the data ``lf-embodied train`` trains on (``data.path``, else the bundled
synthetic dataset; ``--batch-size`` sets ``train.global_batch_size``). LeRobot runs as its
``lerobot_train.py`` runs it on a GPU (``lerobot_recipe``: ``policy.dtype=bfloat16`` with
Accelerate's bf16 autocast around the forward, TF32 matmuls, ``compile_model=true`` in its
``max-autotune`` mode, gradient clipping at the preset's norm) plus fused AdamW, on the same batch
and loss (the masked flow-matching mean). Both sides start from the same weights: LeRobot's random
initialisation, which ours reads as a LeRobot checkpoint (``model.pretrained_format=lerobot``, the
fine-tuning path); the first-step losses must agree. The runs alternate order round by round
(``--rounds``, ``core.bench_protocol.run_rounds``); each run's step time is the median of its timed
steps over all rounds and its peak memory the largest of its rounds. ``--variant
NAME=KEY=VALUE,...`` adds runs of ours with ``train.*`` overrides (the policy and data must stay
the same: the weights and the batch are shared). LeRobot's ``PI05Pytorch`` constructor builds only
the released sizes (``gemma_2b`` + ``gemma_300m``), so ``--against-lerobot`` needs
``model=pi05_base``. ``--lerobot-compile-mode`` picks another of ``torch.compile``'s modes for
LeRobot's ``compile_mode`` (its default, ``max-autotune``, is what the recipe requests; the printed
recipe marks a different mode as a departure from it), or ``none`` for LeRobot uncompiled
(``PI05Config``'s own default, ``compile_model=false``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from loongforge.core.baseline_recipe import BaselineRecipe, tf32_matmuls
from loongforge.core.bench_protocol import check_first_losses
from loongforge.core.benchmarking import profile_tables
from loongforge.core.config import ConfigError
from loongforge.core.training.engine import resolve_dtype
from loongforge.embodied.config import EmbodiedConfig, PolicyConfig

BASELINE = "lerobot"
LEROBOT_COMPILE_MODE = "max-autotune"  # PI05Config.compile_mode's default
UNCOMPILED = "none"  # --lerobot-compile-mode none: PI05Config's own default, compile_model=false
COMPILE_MODES = ("max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead", "default", UNCOMPILED)


def lerobot_recipe(compile_mode: str = LEROBOT_COMPILE_MODE) -> BaselineRecipe:
    """LeRobot's Pi0.5 training as its ``lerobot_train.py`` runs it on a GPU, with fused AdamW;
    ``compile_mode`` other than LeRobot's default is noted as this run's departure from it
    (``none``: not compiled, ``PI05Config``'s default ``compile_model=false``)."""
    if compile_mode not in COMPILE_MODES:
        raise ConfigError(f"--lerobot-compile-mode {compile_mode!r}: one of {', '.join(COMPILE_MODES)}")
    notes: tuple[str, ...] = ("on CPU the bench runs fp32 eager on both sides (a smoke run of the same code)",)
    compiled = compile_mode != UNCOMPILED
    if not compiled:
        notes += ("compile_model = False set by --lerobot-compile-mode none: PI05Config's default (compile_model=false), "
                  "without policy.compile_model=true",)
    elif compile_mode != LEROBOT_COMPILE_MODE:
        notes += (f"compile_mode {compile_mode!r} set by --lerobot-compile-mode: LeRobot's default is "
                  f"{LEROBOT_COMPILE_MODE!r}",)
    return BaselineRecipe(
        project="LeRobot PI05Pytorch",
        source="lerobot_train.py: policy.dtype=bfloat16 drives accelerator.autocast(), TF32 on, policy.compile_model=true",
        options={"dtype": "bfloat16", "autocast": "bfloat16", "tf32": True, "compile_model": compiled,
                 "compile_mode": compile_mode if compiled else None, "fused_adamw": True, "grad_clip_norm": 1.0,
                 "gradient_checkpointing": False},
        cuda_only=frozenset({"dtype", "autocast", "tf32", "compile_model", "compile_mode", "fused_adamw"}),
        notes=notes,
    )


def lerobot_step(model: nn.Module, batch: dict, recipe: BaselineRecipe, device: torch.device,
                 loss_fn: Callable[[dict, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 lr: float = 1e-5) -> Callable[[], torch.Tensor]:
    """A training step of LeRobot's ``PI05Pytorch`` (``forward`` returns per-element losses,
    reduced by ``loss_fn(batch, per_element) -> (sum, count)``: the masked mean ours trains on)
    with the recipe's settings that apply on ``device``: bf16 autocast, clipping, fused AdamW.
    TF32 is the caller's (``tf32_matmuls`` around the run); compilation is the model's own."""
    applied = recipe.applied(device.type)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=bool(applied["fused_adamw"]))
    autocast_dtype = torch.bfloat16 if applied["autocast"] == "bfloat16" else None
    images, masks = list(batch["images"].unbind(1)), list(batch["image_mask"].unbind(1))

    def step():
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            per_element = model.forward(images, masks, batch["tokens"], batch["token_mask"], batch["actions"],
                                        batch["noise"], batch["time"])
        total, count = loss_fn(batch, per_element.float())
        loss = total / count
        loss.backward()
        if applied["grad_clip_norm"]:
            torch.nn.utils.clip_grad_norm_(params, applied["grad_clip_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_lerobot_pi05_released(cfg: PolicyConfig, dtype: str = "bfloat16", compile_model: bool = False,
                                compile_mode: str = "max-autotune") -> nn.Module:
    """LeRobot's ``PI05Pytorch`` at the released size, with ``cfg``'s chunk, padding and image size."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    from loongforge.embodied.policies.pi05 import Pi05Config

    if not isinstance(cfg, Pi05Config):
        raise ValueError(f"LeRobot's PI05Pytorch is a Pi0.5 policy, not model.family={cfg.family!r}: "
                         f"use model=pi05_base for --against-lerobot")
    released = (cfg.vlm.width, cfg.vlm.depth, cfg.expert.width, cfg.vision.hidden_size, cfg.vision.num_layers)
    if released != (2048, 18, 1024, 1152, 27) or cfg.vocab_size != 257152:
        raise ValueError("LeRobot builds Pi0.5 only at its released size: use model=pi05_base for --against-lerobot")
    return PI05Pytorch(PI05Config(
        dtype=dtype, chunk_size=cfg.chunk_size, n_action_steps=cfg.chunk_size, max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim, image_resolution=(cfg.image_size, cfg.image_size), compile_model=compile_model,
        compile_mode=compile_mode,
    ))


def build_lerobot_for_recipe(cfg: PolicyConfig, recipe: BaselineRecipe, device_type: str) -> nn.Module:
    """The released ``PI05Pytorch`` with the recipe's dtype and compilation where they apply."""
    applied = recipe.applied(device_type)
    return build_lerobot_pi05_released(cfg, dtype=str(applied["dtype"] or "float32"),
                                       compile_model=bool(applied["compile_model"]),
                                       compile_mode=str(applied["compile_mode"] or "default"))


@dataclass
class EmbodiedRun:
    """One run's measurements over all rounds."""

    name: str
    samples_per_s: float  # batch size over the median step time
    step_s: float  # median seconds per step over every timed step of every round
    peak_gib: float  # largest peak allocated memory of its rounds; NaN on CPU
    first_loss: float
    tflops: float = float("nan")  # model TFLOP/s (``step_flops`` over the step time)
    mfu: float = float("nan")  # model FLOP/s over the measured matmul peak of the run's dtype


def bench_config(cfg, scratch: str, pretrained: str | None = None):
    """``cfg`` as the bench trains it (``bench_run_config``: a scratch run directory, no resume, no
    checkpoint) and, with ``pretrained``, LeRobot's initial weights read through
    ``model.pretrained_format=lerobot`` (the same path as fine-tuning a LeRobot checkpoint)."""
    from loongforge.core.bench_protocol import bench_run_config

    cfg = bench_run_config(cfg, scratch)
    if pretrained is not None:
        cfg.model.pretrained, cfg.model.pretrained_format = pretrained, "lerobot"
    return cfg


def step_flops(cfg, ctx, scratch: str, batch_size: int) -> float:
    """Model FLOPs of one training step of ``cfg``'s policy on ``batch_size`` samples: those torch
    counts (``counted_flops``) in one step of ours on one sample, uncompiled and without
    recomputation, times ``batch_size`` (every sample has the same shapes: images, padded prompt,
    action chunk)."""
    from loongforge.core.bench_protocol import training_step
    from loongforge.core.benchmarking import counted_flops
    from loongforge.embodied.config import make_task

    one = bench_config(cfg, scratch)
    one.train.compile, one.train.recompute = False, "none"
    one.train.global_batch_size, one.train.micro_batch_size = 1, None
    step, _ = training_step(make_task(one), ctx, one)
    try:
        return counted_flops(step) * batch_size
    finally:
        del step
        from loongforge.core.bench_protocol import free_device_memory

        free_device_memory(ctx.accelerator)


def run_bench(cfgs: Mapping[str, EmbodiedConfig], ctx, steps: int = 10, warmup: int = 3, rounds: int = 2,
              against_lerobot: bool = False,
              build_baseline: Callable[[PolicyConfig, BaselineRecipe, str], nn.Module] = build_lerobot_for_recipe,
              report: Callable[[str], None] = print, seed: int = 0, profile_rows: int = 0,
              trace: str | None = None, lerobot_compile_mode: str = LEROBOT_COMPILE_MODE) -> dict[str, EmbodiedRun]:
    """Ours (``cfgs["ours"]``, a whole ``lf-embodied train`` config) and its variants (the other
    ``cfgs``), each ``Trainer.train_step`` of the policy task on the first step of the data
    ``lf-embodied train`` trains on, and, with ``against_lerobot``, LeRobot's Pi0.5
    (``build_baseline``) on the same batch from the same weights, alternating order round by
    round; then, on CUDA with ``profile_rows``, the profiler tables of two more steps of ours.
    Raises ``FirstLossMismatch`` when a first-step loss differs from the baseline's (else from ours)."""
    import tempfile

    from safetensors.torch import save_file

    from loongforge.core.bench_protocol import Side, run_rounds, training_step
    from loongforge.embodied.config import make_task
    from loongforge.embodied.task import masked_flow_loss

    device = ctx.device
    ours_cfg = cfgs["ours"]
    dtype = resolve_dtype(ours_cfg.train.precision, device)
    for name, cfg in cfgs.items():
        if resolve_dtype(cfg.train.precision, device) != dtype:
            raise ValueError(f"run {name}: train.precision must be the same as ours' (the first-step losses are compared)")
    scratch = tempfile.TemporaryDirectory(prefix="lf-embodied-bench-")
    task = make_task(bench_config(ours_cfg, scratch.name))
    task.prepare(ctx)
    step_batch = next(iter(task.steps(ctx, 0)))  # the first step lf-embodied train takes
    batch = {k: torch.cat([m[k] for m in step_batch.micro_batches]) for k in step_batch.micro_batches[0]}
    batch_size = len(batch["actions"])
    recipe = lerobot_recipe(lerobot_compile_mode)
    sides: list[Side] = []
    pretrained = None
    if against_lerobot:
        for line in recipe.lines(device.type):
            report(line)
        torch.manual_seed(seed)
        with tf32_matmuls(recipe.applies("tf32", device.type)):  # LeRobot's constructor may set it when compiling
            ref = build_baseline(ours_cfg.model, recipe, device.type)
        initial = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
        pretrained = f"{scratch.name}/lerobot_initial.safetensors"
        save_file(initial, pretrained)

        def lerobot_start():
            ref.load_state_dict(initial)
            return lerobot_step(ref.to(device), batch, recipe, device, masked_flow_loss), lambda: ref.to("cpu")

        sides.append(Side(BASELINE, lerobot_start, tf32=bool(recipe.applied(device.type)["tf32"])))

    def ours_start(cfg):
        run_cfg = bench_config(cfg, scratch.name, pretrained)
        step, _ = training_step(make_task(run_cfg), ctx, run_cfg, step_batch)
        return step, lambda: None

    for name, cfg in cfgs.items():
        sides.append(Side(name, partial(ours_start, cfg)))
    timed = run_rounds(sides, [BASELINE] if against_lerobot else [], rounds, steps, warmup, report)
    from loongforge.core.benchmarking import BenchDevice

    flops = step_flops(ours_cfg, ctx, scratch.name, batch_size)
    dev = BenchDevice()
    peak = dev.matmul_peak()
    report(f"model FLOPs: {flops / 1e12:.4f} TFLOP/step (counted by torch in one uncompiled step of one sample, "
           f"times {batch_size}); measured {str(dev.dtype).removeprefix('torch.')} matmul {peak / 1e12:.1f} TFLOP/s")
    results = {name: EmbodiedRun(name, batch_size / t.step_s, t.step_s, t.peak_gib, t.first_loss,
                                 flops / t.step_s / 1e12, flops / t.step_s / peak)
               for name, t in timed.items()}
    reference = BASELINE if against_lerobot else "ours"
    for line in check_first_losses({n: r.first_loss for n, r in results.items()}, reference, dtype):
        report(line)
    if profile_rows and device.type == "cuda":
        step, release = ours_start(ours_cfg)
        try:
            step()  # compiled already: this warms the fresh optimizer
            report("\nours, torch.profiler:\n" + profile_tables(step, profile_rows, trace))
        finally:
            release()
            del step
    scratch.cleanup()
    return results


# -- the command --------------------------------------------------------------------------------
def load_runs(config: str | None, overrides: list[str], variants: list[str], batch_size: int | None = None):
    """``{run name: config}``: ours (the config with ``overrides``, and ``train.global_batch_size``
    set to ``batch_size`` when given), then each ``--variant NAME=KEY=VALUE,...`` (``train.*``
    overrides on top; the policy must stay ours: the runs share weights)."""
    from loongforge.core.benchmarking import parse_variant
    from loongforge.embodied.config import load_train_config

    if batch_size is not None:
        overrides = [*overrides, f"train.global_batch_size={batch_size}"]
    cfg = load_train_config(config, overrides)
    cfgs = {"ours": cfg}
    for spec in variants:
        name, items = parse_variant(spec, [BASELINE, *cfgs], reserved_prefix=BASELINE)
        variant = load_train_config(config, [*overrides, *items])
        if variant.model != cfg.model or variant.data != cfg.data:
            raise ConfigError(f"--variant {spec!r}: a variant changes train.* only (the runs share the policy's "
                              f"weights and the batch)")
        cfgs[name] = variant
    return cfgs


def bench_from_config(config: str | None, overrides: list[str], variants: list[str], batch_size: int | None, steps: int,
                      warmup: int, rounds: int, against_lerobot: bool, profile_rows: int = 0, trace: str | None = None,
                      lerobot_compile_mode: str = LEROBOT_COMPILE_MODE,
                      report: Callable[[str], None] = print) -> dict[str, EmbodiedRun]:
    """``lf-embodied bench`` in this process: the runs of ``load_runs``, timed by ``run_bench`` in the
    process groups ``lf-embodied train`` makes (a world of one)."""
    from loongforge.core.bench_protocol import bench_world

    cfgs = load_runs(config, overrides, variants, batch_size)
    with bench_world(cfgs["ours"].train.seed) as ctx:
        return run_bench(cfgs, ctx, steps, warmup, rounds, against_lerobot, report=report,
                         profile_rows=profile_rows, trace=trace, lerobot_compile_mode=lerobot_compile_mode)


def step_seconds_from_config(**kwargs) -> dict[str, float]:
    """``bench_from_config``'s median seconds per step of each run (one process of ``--processes``)."""
    return {name: r.step_s for name, r in bench_from_config(**kwargs).items()}


def results_lines(results: Mapping[str, EmbodiedRun]) -> list[str]:
    """The final table: samples/s, step time, peak memory, first-step loss, model TFLOP/s, MFU and
    the speed-up over LeRobot."""
    base = results.get(BASELINE)
    lines = [f"{'run':<16}{'samples/s':>11}{'ms/step':>10}{'peak GiB':>10}{'loss@1':>10}{'TFLOP/s':>9}{'MFU':>8}"
             + (f"{'x lerobot':>11}" if base else "")]
    for name, r in results.items():
        ratio = f"{base.step_s / r.step_s:>11.2f}" if base else ""
        lines.append(f"{name:<16}{r.samples_per_s:>11.2f}{r.step_s * 1e3:>10.1f}{r.peak_gib:>10.2f}{r.first_loss:>10.5f}"
                     f"{r.tflops:>9.2f}{r.mfu:>8.1%}{ratio}")
    return lines
