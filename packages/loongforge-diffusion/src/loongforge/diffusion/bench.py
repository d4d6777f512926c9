"""``lf-diffusion bench``: our training step against diffusers' Wan training step, side by side in
one process on the same config, weights and data.

The baseline is set up as diffusers recommends for training on a GPU (``diffusers_recipe``):
``WanTransformer3DModel`` with SDPA attention, its transformer blocks compiled by
``compile_repeated_blocks()`` (whenever ours compiles: ``train.compile``, null on CUDA), fused
AdamW and TF32 on CUDA, bf16 autocast, on a ``[B, C, F, H, W]`` batch, MSE to the velocity. The
headline row compares ours with the same gradient-checkpointing policy: diffusers checkpoints
whole blocks (``enable_gradient_checkpointing``) when the config recomputes anything, and the
headline ``loongforge`` run then uses ``train.recompute=full``; the preset's own policy (e.g.
``selective``) runs as ``loongforge_preset`` after it. The headline run keeps no EMA weights either,
as diffusers' step (``headline_recipe``). Ours is what ``lf-diffusion train`` runs:
``Trainer.train_step`` of ``FlowMatchingTask`` on the torch engine built from the config (its precision,
regional ``torch.compile``, recomputation, fused AdamW, clipping; the packed ``WanDiT`` with the
``auto`` attention backend and kernels from the registry), with the task's loss weights, on the
bench's packed batch, from the weights diffusers starts from.
An image-to-video config (``model.condition=i2v``, Wan 2.1 I2V) runs the same way on image-conditioned
inputs (``conditioning.model_input``: mask and condition latents on channels, and with
``model.image_dim`` the image's CLIP tokens); TI2V's per-token timesteps are not benchmarked.

The runs alternate order round by round (``--rounds``: diffusers first, then ours first, ...;
``core.bench_protocol.run_rounds``), each built afresh in its round; a run's step time is the
median over its timed steps of all rounds, and its peak memory the largest of its rounds. Every run's first-step loss must agree with the baseline's
(``FirstLossMismatch`` otherwise) and its last timed step's must be finite. Extra variants of
ours (config overrides, e.g. ``train.recompute=none``) run after the headline ones, in one round
of their own (a failing one is reported and left out); the profiler
table and the attention-kernel timings come after the headline result, and a failure in them is
reported without hiding it.
"""

from __future__ import annotations

import math
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loongforge.core.accelerators import get_accelerator
from loongforge.core.baseline_recipe import BaselineRecipe
from loongforge.core.bench_protocol import FirstLossMismatch, first_loss_tolerance, losses_agree
from loongforge.core.benchmarking import profile_tables
from loongforge.core.training.engine import resolve_dtype
from loongforge.diffusion.conditioning import ImageCondition, model_input
from loongforge.diffusion.model import WanDiT
from loongforge.diffusion.objective import noisy_and_target
from loongforge.diffusion.packing import num_tokens, pack, pack_targets


@dataclass
class RunResult:
    name: str
    step_s: float  # median seconds per step over every timed step of every round
    peak_bytes: float  # the largest peak of allocated device memory of its rounds (NaN on the CPU)
    first_loss: float
    last_loss: float  # of the last timed step: training stayed finite

    @classmethod
    def of(cls, times) -> RunResult:
        """From ``run_rounds``' ``SideTimes``."""
        return cls(times.name, times.step_s, times.peak_gib * 2**30, times.first_loss, times.last_loss)


# Wan 2.1 I2V's image tokens: its CLIP ViT-H/14's penultimate hidden states at 224 px (256 patches + CLS)
CLIP_TOKENS = 257
# diffusers' Wan I2V attention takes the last 512 context tokens as the prompt and those before them as
# the image's (``WanAttnProcessor``), so its baseline needs prompts of exactly this length
DIFFUSERS_I2V_TEXT_LEN = 512


# The spatial compression of the Wan VAE a model's latents come from, by their channels: Wan 2.2's
# (48 channels, of TI2V 5B) 16x; Wan 2.1's (16) and any other (the tiny test models') 8x; all 4x in time
WAN22_VAE_CHANNELS = 48


def _latent_shape(recipe) -> tuple[int, int, int, int]:
    """The noisy latent of one sample, ``[C, F, h, w]`` (C: the model's output channels; an I2V
    model's input adds its mask and condition channels), of a ``sample.num_frames x height x
    width`` video through the Wan VAE of C latent channels (16x spatially for Wan 2.2's 48, else 8x)."""
    s, m = recipe.sample, recipe.model
    f = 16 if m.out_channels == WAN22_VAE_CHANNELS else 8
    return (m.out_channels, 1 + (s.num_frames - 1) // 4, s.height // f, s.width // f)


def check_benchmarkable(m) -> None:
    """Refuse, naming the key, what the bench does not compare with diffusers."""
    from loongforge.core.config import ConfigError

    if m.family != "wan":
        raise ConfigError(f"model.family={m.family!r}: lf-diffusion bench times the Wan DiT against diffusers' "
                          f"WanTransformer3DModel")
    if m.condition == "ti2v":
        raise ConfigError("model.condition='ti2v': lf-diffusion bench measures text-to-video and Wan 2.1 "
                          "image-to-video (i2v) configs, not TI2V's per-token timesteps (model.condition=none "
                          "benches the same model text-to-video: --config bench_wan2_2_ti2v_5b)")
    if m.condition == "i2v" and m.image_dim is not None and m.text_len != DIFFUSERS_I2V_TEXT_LEN:
        raise ConfigError(f"model.text_len={m.text_len}: diffusers' Wan I2V attention reads the last "
                          f"{DIFFUSERS_I2V_TEXT_LEN} context tokens as the prompt, so the I2V baseline needs "
                          f"model.text_len={DIFFUSERS_I2V_TEXT_LEN}")


def variant_recipe(base, overrides: Sequence[str]):
    """``base`` (the bench's recipe) with ``key=value`` config overrides (``train.recompute=none``,
    ``model.fp8=tensorwise``), validated like the config file."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from loongforge.core.config import ConfigError

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"bench variant {item!r} is not of the form key=value (a config key)")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(base), OmegaConf.from_dotlist(list(overrides))))
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"bench variant {' '.join(overrides)!r}: {str(exc).splitlines()[0]}") from exc


def compiles(recipe, device_type: str) -> bool:
    """``train.compile``; when null, on CUDA without context parallelism (as the engine decides)."""
    return recipe.train.compile if recipe.train.compile is not None else device_type == "cuda" and recipe.parallel.cp == 1


def headline_recompute(recipe) -> str:
    """Ours' recomputation in the headline row: diffusers' policy, whole-block checkpointing
    (``full``) when the config recomputes anything, else none."""
    return "full" if recipe.train.recompute != "none" else "none"


def headline_recipe(recipe):
    """Ours in the headline row: the config at diffusers' step's settings, its checkpointing
    (``headline_recompute``) and no EMA weights (diffusers' step keeps none; the preset's EMA is an
    fp32 copy of the model, 5.3 GiB at 1.3B, and an update every step)."""
    return variant_recipe(recipe, [f"train.recompute={headline_recompute(recipe)}", "ema.decay=0.0"])


def diffusers_recipe(recipe) -> BaselineRecipe:
    """diffusers' Wan training step as its documentation recommends on a GPU, with the gradient
    checkpointing of the headline row."""
    return BaselineRecipe(
        project="diffusers WanTransformer3DModel",
        source="diffusers training docs: regional compilation, fused AdamW, TF32, bf16 mixed precision",
        options={"attention": "sdpa", "compile_repeated_blocks": True, "fused_adamw": True, "tf32": True,
                 "autocast": "bfloat16", "gradient_checkpointing": recipe.train.recompute != "none"},
        cuda_only=frozenset({"fused_adamw", "tf32", "autocast"}),
        notes=("compile_repeated_blocks applies whenever ours compiles (train.compile; null: on CUDA)",
               f"headline row: ours with train.recompute={headline_recompute(recipe)} (the same checkpointing) "
               f"and ema.decay=0 (no EMA weights, as diffusers' step)"),
    )


def describe(recipe, device_type: str) -> str:
    compiled = "compiled" if compiles(recipe, device_type) else "eager"
    return (f"{compiled}, recompute={recipe.train.recompute}, attention={recipe.model.attention_backend}, "
            f"fp8={recipe.model.fp8}, ema={recipe.ema.decay:g}")


class Bench:
    """The shared data and weights, and one timed run per model."""

    def __init__(self, recipe, steps: int = 10, warmup: int = 3, batch_size: int = 1):
        accel = get_accelerator()
        self.accel, self.device = accel, accel.device()
        self.dtype = resolve_dtype(recipe.train.precision, self.device)
        self.recipe, self.steps, self.warmup, self.batch_size = recipe, steps, warmup, batch_size
        m = recipe.model
        torch.manual_seed(recipe.train.seed)
        self.initial_state = {k: v.clone() for k, v in WanDiT(m).state_dict().items()}

        self.shape = shape = _latent_shape(recipe)
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn((batch_size, *shape), generator=g)
        noise = torch.randn((batch_size, *shape), generator=g)
        sigma = torch.rand(batch_size, generator=g)
        text = torch.randn(batch_size, m.text_len, m.text_dim, generator=g)
        pairs = [noisy_and_target(x0[i], noise[i], sigma[i].item()) for i in range(batch_size)]
        xt = torch.stack([p[0] for p in pairs])
        target = torch.stack([p[1] for p in pairs])
        image = None
        if m.condition == "i2v":  # the DiT input: noisy latent, first-frame mask, condition latents
            cond_channels = m.in_channels - m.out_channels - m.mask_channels
            cond = torch.randn((batch_size, cond_channels, *shape[1:]), generator=g)
            xt = torch.stack([model_input(m, xt[i], ImageCondition(cond[i])) for i in range(batch_size)])
            if m.image_dim is not None:
                image = torch.randn(batch_size, CLIP_TOKENS, m.image_dim, generator=g)
        timesteps = sigma * recipe.objective.num_train_timesteps
        self.batch = pack(list(xt), timesteps, text, m.patch_size, image=image).to(self.device)
        self.packed_target = pack_targets(list(target), m.patch_size).to(self.device)
        self.video = tuple(t.to(self.device) for t in (xt, target, timesteps, text))
        self.image = image.to(self.device) if image is not None else None
        self.tokens = batch_size * num_tokens(shape, m.patch_size)

    # -- the two training steps ---------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def diffusers_step(self, baseline: BaselineRecipe):
        """diffusers' training step per ``baseline`` (its checkpointing, regional compilation where
        ours compiles, fused AdamW) from the shared initial weights, on the bench's batch: bf16
        autocast, MSE to the velocity. Returns the step and a release that moves the model back
        to the host."""
        from diffusers import WanTransformer3DModel

        m = self.recipe.model
        applied = baseline.applied(self.device.type)
        model = WanTransformer3DModel(**m.diffusers_kwargs())
        model.load_state_dict(self.initial_state)
        if applied["gradient_checkpointing"]:
            model.enable_gradient_checkpointing()
        model = model.to(self.device)
        if applied["compile_repeated_blocks"] and compiles(self.recipe, self.device.type):
            import torch._dynamo as dynamo

            dynamo.reset()
            model.compile_repeated_blocks(dynamic=False)
        xt, target, timesteps, text = self.video
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=bool(applied["fused_adamw"]))

        def step():
            with self._autocast():
                pred = model(xt, timesteps, text, encoder_hidden_states_image=self.image, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), target.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step, lambda: model.to("cpu")

    def ours_step(self, recipe, ctx):
        """Ours as ``lf-diffusion train`` runs it: ``Trainer.train_step`` of ``FlowMatchingTask`` on the torch
        engine built from ``recipe`` (precision, regional compilation, recomputation, fused AdamW,
        clipping), the task's loss (per-token weights of ``train.loss_reduction``) on the bench's
        packed batch, from the shared initial weights. Returns the step and the trainer."""
        from loongforge.core.bench_protocol import training_step
        from loongforge.core.training.task import StepBatch
        from loongforge.diffusion.objective import token_weights
        from loongforge.diffusion.task import FlowMatchingTask

        task = FlowMatchingTask(recipe)
        expert = task.trainable[0]
        weights = token_weights([self.tokens // self.batch_size] * self.batch_size, self.batch.num_pad,
                                recipe.objective.loss_reduction, task.features)
        micro = {"batch": self.batch, "target": self.packed_target, "weights": weights.to(self.device), "cp": None}
        step, trainer = training_step(task, ctx, recipe, StepBatch(micro_batches=[micro], tokens=self.tokens, part=expert))
        with torch.no_grad():
            trainer.inner_model.expert(expert).load_state_dict(self.initial_state)
        return step, trainer

    # -- diagnostics -----------------------------------------------------------------------
    def attention_kernels(self, iters: int = 10) -> list[tuple[str, float, float]]:
        """(kernel, ms per forward+backward, TFLOP/s) of the self-attention of this shape with
        each CUDA kernel ours can use: SDPA's default pick (cuDNN on Hopper), SDPA flash, and
        flash varlen (the packed backend for multi-sample packs)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.varlen import varlen_attn

        m = self.recipe.model
        n, h, d = self.tokens, m.num_attention_heads, m.attention_head_dim
        q, k, v = (torch.randn(n, h, d, device=self.device, dtype=self.dtype, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, n], dtype=torch.int32, device=self.device)

        def dense():
            return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return dense()

        candidates = {"sdpa (default pick)": dense, "sdpa flash": flash,
                      "varlen flash": lambda: varlen_attn(q, k, v, cu, cu, n, n)}
        flops = 4 * n * n * h * d * 3.5  # forward 4*N^2*H*D, backward 2.5x that
        out = []
        for name, fn in candidates.items():
            try:
                for _ in range(2):
                    fn().sum().backward()
                self.accel.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn().sum().backward()
                self.accel.synchronize()
                s = (time.perf_counter() - t0) / iters
                out.append((name, s * 1e3, flops / s / 1e12))
            except Exception as exc:  # a kernel this build or device lacks
                out.append((f"{name} (unavailable: {str(exc).splitlines()[0][:80]})", float("nan"), float("nan")))
        return out


def run_bench(recipe, steps: int = 10, warmup: int = 3, batch_size: int = 1,
              variants: Sequence[tuple[str, Sequence[str]]] = (), rounds: int = 2,
              profile_rows: int = 25, trace: str | None = None,
              report: Callable[[str], None] = print) -> dict[str, RunResult]:
    """``bench_in_world`` in the process groups ``lf-diffusion train`` makes for a world of one
    (``bench_world``: torn down afterwards when it made them)."""
    from loongforge.core.bench_protocol import bench_world

    with bench_world(recipe.train.seed) as ctx:
        return bench_in_world(recipe, ctx, steps, warmup, batch_size, variants, rounds, profile_rows, trace, report)


def bench_in_world(recipe, ctx, steps: int = 10, warmup: int = 3, batch_size: int = 1,
                   variants: Sequence[tuple[str, Sequence[str]]] = (), rounds: int = 2,
                   profile_rows: int = 25, trace: str | None = None,
                   report: Callable[[str], None] = print) -> dict[str, RunResult]:
    """Time the diffusers step and ours at the same checkpointing (and at the preset's where that
    differs) in ``rounds`` alternating rounds (``run_rounds``), then each variant of ours in one
    round of its own; ``report`` gets every line as soon as it is known. Raises
    ``FirstLossMismatch`` (after reporting everything) when a run's first-step loss disagrees with
    the baseline's or its last is not finite."""
    from loongforge.core.bench_protocol import Side, bench_run_config, free_device_memory, run_rounds

    m = recipe.model
    configs = [(name, o, variant_recipe(recipe, o)) for name, o in variants]  # bad overrides fail before any run
    for r in [recipe] + [c for _, _, c in configs]:
        r.model.check_device(get_accelerator().device_type)
    bench = Bench(recipe, steps, warmup, batch_size)
    device_type = bench.device.type
    scratch = tempfile.TemporaryDirectory(prefix="lf-diffusion-bench-")
    baseline = diffusers_recipe(recipe)
    headline = headline_recipe(recipe)
    ours_runs = {"loongforge": headline}
    if recipe.train.recompute != headline.train.recompute:
        ours_runs["loongforge_preset"] = recipe
    report(f"latents {batch_size} x {recipe.sample.num_frames}x{recipe.sample.height}x{recipe.sample.width} frames, "
           f"{bench.tokens} tokens/step, {m.num_layers} layers, {device_type} {bench.dtype}")
    for text in baseline.lines(device_type):
        report(text)

    fp8_runs = {name: r.model.fp8 != "none" for name, r in ours_runs.items()}
    fp8_runs.update({name: r.model.fp8 != "none" for name, _, r in configs})

    def agrees(r: RunResult) -> bool:
        """First-step loss as the baseline's, and still finite after the timed steps."""
        tol = first_loss_tolerance(bench.dtype, fp8_runs.get(r.name, False))
        return math.isfinite(r.last_loss) and losses_agree(base.first_loss, r.first_loss, tol)

    def line(r: RunResult, base: RunResult | None) -> str:
        text = (f"{r.name:>10}: {r.step_s * 1e3:8.1f} ms/step {bench.tokens / r.step_s:10.0f} tokens/s  "
                f"peak {r.peak_bytes / 2**30:6.2f} GiB  first loss {r.first_loss:.5f}  last {r.last_loss:.5f}")
        if base is not None:
            agree = "" if agrees(r) else "  LOSS MISMATCH OR NOT FINITE"
            text += f"  speed-up {base.step_s / r.step_s:.2f}x{agree}"
        return text

    def ours_side(name: str, run_recipe, may_fail: bool = False) -> Side:
        def start():
            step, _ = bench.ours_step(bench_run_config(run_recipe, scratch.name), ctx)
            return step, lambda: None
        return Side(name, start, may_fail=may_fail)

    sides = [Side("diffusers", lambda: bench.diffusers_step(baseline), tf32=bool(baseline.applied(device_type)["tf32"]))]
    sides += [ours_side(name, r) for name, r in ours_runs.items()]
    results = {name: RunResult.of(t) for name, t in run_rounds(sides, ["diffusers"], rounds, steps, warmup, report).items()}
    base = results["diffusers"]
    report(f"  diffusers: {', '.join(f'{k}={v}' for k, v in baseline.applied(device_type).items())}")
    report(line(base, None))
    for name, run_recipe in ours_runs.items():
        report(f"  {name}: {describe(run_recipe, device_type)}")
        report(line(results[name], base))
    ours = results["loongforge"]
    report(f"speed-up (diffusers step time / loongforge step time, same checkpointing): {base.step_s / ours.step_s:.2f}x")

    if profile_rows and device_type == "cuda":
        step, _ = bench.ours_step(bench_run_config(headline, scratch.name), ctx)
        try:
            report("loongforge, torch.profiler:")
            step()  # compiled and warm
            report(profile_tables(step, profile_rows, trace))
        except Exception:
            report("profiler failed (the results above stand):\n" + traceback.format_exc())
        try:
            report(f"self-attention kernels at this shape ({bench.tokens} tokens, fwd+bwd):")
            for name, ms, tflops in bench.attention_kernels():
                report(f"  {name:<24} {ms:8.2f} ms  {tflops:6.0f} TFLOP/s")
        except Exception:
            report("attention-kernel timing failed (the results above stand):\n" + traceback.format_exc())
        del step
        free_device_memory(bench.accel)

    if configs:  # the variants: one round of their own, after the headline; a failing one is reported
        timed = run_rounds([ours_side(name, variant, may_fail=True) for name, _, variant in configs], [], 1, steps,
                           warmup, report)
        for name, overrides, variant in configs:
            if name in timed:
                results[name] = RunResult.of(timed[name])
                report(f"  {name}: {','.join(overrides)} ({describe(variant, device_type)})")
                report(line(results[name], base))

    scratch.cleanup()
    bad = [r.name for r in results.values() if not agrees(r)]
    if bad:
        raise FirstLossMismatch(f"first-step losses disagree with diffusers ({base.first_loss:.6f}) or the last is not finite: "
                                + ", ".join(f"{n} {results[n].first_loss:.6f} (last {results[n].last_loss:.6f})" for n in bad))
    return results


def step_seconds_from_config(config: str | None, overrides: list[str], **kwargs) -> dict[str, float]:
    """``run_bench`` on the config's recipe: each run's seconds per step (one process of ``--processes``)."""
    from loongforge.diffusion.run_config import load_recipe

    return {name: r.step_s for name, r in run_bench(load_recipe(config, overrides), **kwargs).items()}
