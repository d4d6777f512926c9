"""``lf-embodied bench``: training-step throughput (samples/s) of a policy, and of LeRobot's own
Pi0.5 for the same config, batch and image size, in the same process.

LeRobot runs as its ``lerobot_train.py`` runs it on a GPU (``lerobot_recipe``: ``policy.dtype=
bfloat16`` with Accelerate's bf16 autocast around the forward, TF32 matmuls, ``compile_model=true``
in its ``max-autotune`` mode, gradient clipping at the preset's norm) plus fused AdamW. Both sides
start from the same weights (LeRobot's random initialisation, read into ours through the
``lerobot-to-lf`` mapping) and get the same preprocessed synthetic batch (cameras in [-1, 1],
full-length prompts, padded state/actions); the first-step losses must agree. The runs alternate
order round by round (``--rounds``); each run's step time is the median of its timed steps over
all rounds and its peak memory the largest of its rounds. ``--variant NAME=KEY=VALUE,...`` adds
runs of ours with ``train.*`` overrides (the policy must stay the same: the weights are shared).
LeRobot's ``PI05Pytorch`` constructor builds only the released sizes (``gemma_2b`` + ``gemma_300m``),
so ``--against-lerobot`` needs ``policy=pi05_base``. ``--lerobot-compile-mode`` picks another of
``torch.compile``'s modes for LeRobot's ``compile_mode`` (its default, ``max-autotune``, is what
the recipe requests; the printed recipe marks a different mode as a departure from it).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from loongforge.core.baseline_recipe import BaselineRecipe, tf32_matmuls
from loongforge.core.bench_protocol import alternating_orders, check_first_losses, timed_steps
from loongforge.core.benchmarking import profile_tables
from loongforge.core.config import ConfigError
from loongforge.core.training import torch_parallel
from loongforge.core.training.engine import resolve_dtype
from loongforge.core.training.schema import TrainConfig
from loongforge.embodied.config import PolicyConfig

BASELINE = "lerobot"
LEROBOT_COMPILE_MODE = "max-autotune"  # PI05Config.compile_mode's default
COMPILE_MODES = ("max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead", "default")


def lerobot_recipe(compile_mode: str = LEROBOT_COMPILE_MODE) -> BaselineRecipe:
    """LeRobot's Pi0.5 training as its ``lerobot_train.py`` runs it on a GPU, with fused AdamW;
    ``compile_mode`` other than LeRobot's default is noted as this run's departure from it."""
    if compile_mode not in COMPILE_MODES:
        raise ConfigError(f"--lerobot-compile-mode {compile_mode!r}: one of {', '.join(COMPILE_MODES)}")
    notes = ("on CPU the bench runs fp32 eager on both sides (a smoke run of the same code)",)
    if compile_mode != LEROBOT_COMPILE_MODE:
        notes += (f"compile_mode {compile_mode!r} set by --lerobot-compile-mode: LeRobot's default is "
                  f"{LEROBOT_COMPILE_MODE!r}",)
    return BaselineRecipe(
        project="LeRobot PI05Pytorch",
        source="lerobot_train.py: policy.dtype=bfloat16 drives accelerator.autocast(), TF32 on, policy.compile_model=true",
        options={"dtype": "bfloat16", "autocast": "bfloat16", "tf32": True, "compile_model": True,
                 "compile_mode": compile_mode, "fused_adamw": True, "grad_clip_norm": 1.0,
                 "gradient_checkpointing": False},
        cuda_only=frozenset({"dtype", "autocast", "tf32", "compile_model", "compile_mode", "fused_adamw"}),
        notes=notes,
    )


def synthetic_batch(cfg: PolicyConfig, batch_size: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, n, s = batch_size, cfg.num_cameras, cfg.image_size
    batch = {
        "images": torch.rand(b, n, 3, s, s, generator=g) * 2 - 1,
        "image_mask": torch.ones(b, n, dtype=torch.bool),
        "tokens": torch.randint(4, min(cfg.vocab_size, 516), (b, cfg.max_token_len), generator=g),
        "token_mask": torch.ones(b, cfg.max_token_len, dtype=torch.bool),
        "state": torch.rand(b, cfg.max_state_dim, generator=g) * 2 - 1,
        "actions": torch.rand(b, cfg.chunk_size, cfg.max_action_dim, generator=g) * 2 - 1,
        "noise": torch.randn(b, cfg.chunk_size, cfg.max_action_dim, generator=g),
        "time": torch.rand(b, generator=g) * 0.999 + 0.001,
    }
    return {k: v.to(device) for k, v in batch.items()}


def loongforge_step(policy: nn.Module, train: TrainConfig, device: torch.device, batch: dict,
                    lr: float = 1e-5) -> Callable[[], torch.Tensor]:
    """Our training step as the engine runs it on one process: ``train.recompute``, regional
    compilation per ``train.compile`` (null: on CUDA), autocast per ``train.precision``, clipping
    to ``train.clip_grad``, AdamW (fused on CUDA). The step returns its loss (before the update)."""
    model = policy.to(device)
    model.set_recompute(train.recompute)
    if train.compile if train.compile is not None else device.type == "cuda":
        for block in model.repeated_blocks():
            block.compile()
    model.train()
    dtype = resolve_dtype(train.precision, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=device.type == "cuda")

    def step():
        with torch_parallel.autocast(device.type, dtype):
            loss = model(batch, batch["noise"], batch["time"]).mean()
        loss.backward()
        if train.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, train.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def lerobot_step(model: nn.Module, batch: dict, recipe: BaselineRecipe, device: torch.device,
                 lr: float = 1e-5) -> Callable[[], torch.Tensor]:
    """A training step of LeRobot's ``PI05Pytorch`` (``forward`` returns per-element losses) with
    the recipe's settings that apply on ``device``: bf16 autocast, clipping, fused AdamW. TF32
    is the caller's (``tf32_matmuls`` around the run); compilation is the model's own."""
    applied = recipe.applied(device.type)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=bool(applied["fused_adamw"]))
    autocast_dtype = torch.bfloat16 if applied["autocast"] == "bfloat16" else None
    images, masks = list(batch["images"].unbind(1)), list(batch["image_mask"].unbind(1))

    def step():
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = model.forward(images, masks, batch["tokens"], batch["token_mask"], batch["actions"],
                                 batch["noise"], batch["time"]).mean()
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

    released = (cfg.vlm.width, cfg.vlm.depth, cfg.expert.width, cfg.vision.hidden_size, cfg.vision.num_layers)
    if released != (2048, 18, 1024, 1152, 27) or cfg.vocab_size != 257152:
        raise ValueError("LeRobot builds Pi0.5 only at its released size: use policy=pi05_base for --against-lerobot")
    return PI05Pytorch(PI05Config(
        dtype=dtype, chunk_size=cfg.chunk_size, n_action_steps=cfg.chunk_size, max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim, image_resolution=(cfg.image_size, cfg.image_size), compile_model=compile_model,
        compile_mode=compile_mode,
    ))


def build_lerobot_for_recipe(cfg: PolicyConfig, recipe: BaselineRecipe, device_type: str) -> nn.Module:
    """The released ``PI05Pytorch`` with the recipe's dtype and compilation where they apply."""
    applied = recipe.applied(device_type)
    return build_lerobot_pi05_released(cfg, dtype=applied["dtype"] or "float32",
                                       compile_model=bool(applied["compile_model"]),
                                       compile_mode=applied["compile_mode"] or "default")


@dataclass
class EmbodiedRun:
    """One run's measurements over all rounds."""

    name: str
    samples_per_s: float  # batch size over the median step time
    step_s: float  # median seconds per step over every timed step of every round
    peak_gib: float  # largest peak allocated memory of its rounds; NaN on CPU
    first_loss: float


@dataclass
class _Side:
    name: str
    model: nn.Module  # kept on the CPU between rounds
    initial: dict  # its initial weights (CPU), loaded again before each round
    make_step: Callable[[nn.Module], Callable[[], torch.Tensor]]
    tf32: bool = False


def run_bench(policy_cfg: PolicyConfig, trains: Mapping[str, TrainConfig], batch_size: int, steps: int = 10,
              warmup: int = 3, rounds: int = 2, against_lerobot: bool = False,
              build_baseline: Callable[[PolicyConfig, BaselineRecipe, str], nn.Module] = build_lerobot_for_recipe,
              report: Callable[[str], None] = print, seed: int = 0, profile_rows: int = 0,
              trace: str | None = None, lerobot_compile_mode: str = LEROBOT_COMPILE_MODE) -> dict[str, EmbodiedRun]:
    """Ours (``trains["ours"]``), its variants (the other ``trains``) and, with ``against_lerobot``,
    LeRobot's Pi0.5 (``build_baseline``), alternating order round by round; then, on CUDA with
    ``profile_rows``, the profiler tables of two more steps of ours. Raises ``FirstLossMismatch``
    when a first-step loss differs from the baseline's (else from ours)."""
    from loongforge.core.accelerators import get_accelerator
    from loongforge.embodied.convert.lerobot_pi05 import from_lerobot_pi05
    from loongforge.embodied.policies import build_policy

    accel = get_accelerator()
    device = accel.device()
    dtype = resolve_dtype(trains["ours"].precision, device)
    for name, train in trains.items():
        if resolve_dtype(train.precision, device) != dtype:
            raise ValueError(f"run {name}: train.precision must be the same as ours' (the first-step losses are compared)")
    batch = synthetic_batch(policy_cfg, batch_size, device, seed=seed)
    recipe = lerobot_recipe(lerobot_compile_mode)
    sides: list[_Side] = []
    torch.manual_seed(seed)
    if against_lerobot:
        for line in recipe.lines(device.type):
            report(line)
        with tf32_matmuls(recipe.applies("tf32", device.type)):  # LeRobot's constructor may set it when compiling
            ref = build_baseline(policy_cfg, recipe, device.type)
        initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        sides.append(_Side(BASELINE, ref, initial, lambda m: lerobot_step(m, batch, recipe, device),
                           tf32=bool(recipe.applied(device.type)["tf32"])))
        ours_initial = from_lerobot_pi05(initial)
    else:
        ours_initial = {k: v.detach().clone() for k, v in build_policy(policy_cfg).state_dict().items()}
    for name, train in trains.items():
        policy = build_policy(policy_cfg)
        sides.append(_Side(name, policy, ours_initial,
                           lambda m, train=train: loongforge_step(m, train, device, batch)))

    by_name = {s.name: s for s in sides}
    times: dict[str, list[float]] = {s.name: [] for s in sides}
    peaks: dict[str, float] = {s.name: float("nan") if device.type == "cpu" else 0.0 for s in sides}
    firsts: dict[str, float] = {}
    baselines = [BASELINE] if against_lerobot else []
    for r, order in enumerate(alternating_orders(baselines, list(trains), rounds)):
        report(f"round {r + 1} of {rounds}: {', '.join(order)}")
        for name in order:
            side = by_name[name]
            side.model.load_state_dict(side.initial)
            if device.type != "cpu":
                accel.reset_peak_memory_stats()
            with tf32_matmuls(side.tf32):
                step = side.make_step(side.model.to(device))
                first, seconds = timed_steps(step, steps, warmup, accel.synchronize)
            del step
            side.model.to("cpu")
            if device.type != "cpu":
                peaks[name] = max(peaks[name], accel.memory_stats().peak_allocated / 2**30)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            firsts.setdefault(name, first)
            times[name] += seconds
            report(f"  {name}: {statistics.median(seconds) * 1e3:.1f} ms/step (median of {len(seconds)}), first-step loss {first:.5f}")
    results = {}
    for name in times:
        step_s = statistics.median(times[name])
        results[name] = EmbodiedRun(name, batch_size / step_s, step_s, peaks[name], firsts[name])
    reference = BASELINE if against_lerobot else "ours"
    for line in check_first_losses(firsts, reference, dtype):
        report(line)
    if profile_rows and device.type == "cuda":
        ours = by_name["ours"]
        with tf32_matmuls(ours.tf32):
            step = ours.make_step(ours.model.to(device))
            step()  # compiled already: this warms the fresh optimizer
            report("\nours, torch.profiler:\n" + profile_tables(step, profile_rows, trace))
        del step
        ours.model.to("cpu")
    return results


# -- the command --------------------------------------------------------------------------------
def load_runs(config: str | None, overrides: list[str], variants: list[str]):
    """The bench config and ``{run name: TrainConfig}``: ours, then each ``--variant NAME=KEY=VALUE,...``
    (``train.*`` overrides on top of ``overrides``; the policy must stay ours: the runs share weights)."""
    from loongforge.core.benchmarking import parse_variant
    from loongforge.embodied.config import load_train_config

    cfg = load_train_config(config, overrides)
    trains = {"ours": cfg.train}
    for spec in variants:
        name, items = parse_variant(spec, [BASELINE, *trains], reserved_prefix=BASELINE)
        variant = load_train_config(config, [*overrides, *items])
        if variant.policy != cfg.policy:
            raise ConfigError(f"--variant {spec!r}: a variant changes train.* only (the runs share the policy's weights)")
        trains[name] = variant.train
    return cfg, trains


def bench_from_config(config: str | None, overrides: list[str], variants: list[str], batch_size: int, steps: int,
                      warmup: int, rounds: int, against_lerobot: bool, profile_rows: int = 0, trace: str | None = None,
                      lerobot_compile_mode: str = LEROBOT_COMPILE_MODE,
                      report: Callable[[str], None] = print) -> dict[str, EmbodiedRun]:
    """``lf-embodied bench`` in this process: the runs of ``load_runs``, timed by ``run_bench``."""
    from loongforge.core.distributed import init_distributed

    cfg, trains = load_runs(config, overrides, variants)
    init_distributed(group_for_world_of_one=False)
    return run_bench(cfg.policy, trains, batch_size, steps, warmup, rounds, against_lerobot, report=report,
                     profile_rows=profile_rows, trace=trace, lerobot_compile_mode=lerobot_compile_mode)


def step_seconds_from_config(**kwargs) -> dict[str, float]:
    """``bench_from_config``'s median seconds per step of each run (one process of ``--processes``)."""
    return {name: r.step_s for name, r in bench_from_config(**kwargs).items()}


def results_lines(results: Mapping[str, EmbodiedRun]) -> list[str]:
    """The final table: samples/s, step time, peak memory, first-step loss, and the speed-up over LeRobot."""
    base = results.get(BASELINE)
    lines = [f"{'run':<16}{'samples/s':>11}{'ms/step':>10}{'peak GiB':>10}{'loss@1':>10}" + (f"{'x lerobot':>11}" if base else "")]
    for name, r in results.items():
        ratio = f"{base.step_s / r.step_s:>11.2f}" if base else ""
        lines.append(f"{name:<16}{r.samples_per_s:>11.2f}{r.step_s * 1e3:>10.1f}{r.peak_gib:>10.2f}{r.first_loss:>10.5f}{ratio}")
    return lines
