"""``lf-diffusion bench``: our training step against a plain diffusers training step, side by side
in one process on the same config, weights and data.

The baseline is what a diffusers training script does: ``WanTransformer3DModel`` (eager, SDPA
attention, its gradient checkpointing when the config checkpoints activations) on a
``[B, C, F, H, W]`` batch, MSE to the velocity, backward, AdamW. Ours is the LoongForge step: the
packed ``WanDiT`` (regional ``torch.compile`` per ``train.compile``, the config's recomputation
policy, the ``auto`` attention backend, kernels from the registry) with the same objective and
fused AdamW on CUDA. Both use bf16 autocast on GPUs (fp32 on CPU).

Every run reports its step time split into forward (with the loss), backward and optimizer, from
CUDA events on a GPU (no host sync inside the step) or the wall clock elsewhere. Each run's
first-step loss must agree with the baseline's, and its last timed step's must be finite. Extra
variants of ours (config overrides, e.g. ``train.recompute=none``) run after the
headline one. Results are reported as soon
as each run ends; the profiler table and the attention-kernel timings come after the headline
result, and a failure in them is reported without hiding it.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loongforge.core.accelerators import get_accelerator
from loongforge.core.training.engine import resolve_dtype
from loongforge.diffusion.model import WanDiT
from loongforge.diffusion.objective import noisy_and_target
from loongforge.diffusion.packing import num_tokens, pack, pack_targets


@dataclass
class RunResult:
    name: str
    step_s: float  # wall clock per step
    forward_s: float  # per step, phase by phase
    backward_s: float
    optimizer_s: float
    peak_bytes: float
    first_loss: float
    last_loss: float  # of the last timed step: training stayed finite


class _Clock:
    """Timestamps between the phases of a step: CUDA events on a GPU, the wall clock elsewhere
    (where kernels run synchronously)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _latent_shape(recipe) -> tuple[int, int, int, int]:
    s, m = recipe.sample, recipe.model
    return (m.in_channels, 1 + (s.num_frames - 1) // 4, s.height // 8, s.width // 8)


def variant_recipe(base, overrides: list[str]):
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


def describe(recipe, device_type: str) -> str:
    compiled = "compiled" if compiles(recipe, device_type) else "eager"
    return (f"{compiled}, recompute={recipe.train.recompute}, attention={recipe.model.attention_backend}, "
            f"fp8={recipe.model.fp8}")


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
        timesteps = sigma * recipe.objective.num_train_timesteps
        self.batch = pack(list(xt), timesteps, text, m.patch_size).to(self.device)
        self.packed_target = pack_targets(list(target), m.patch_size).to(self.device)
        self.video = tuple(t.to(self.device) for t in (xt, target, timesteps, text))
        self.tokens = batch_size * num_tokens(shape, m.patch_size)

    # -- the two training steps ---------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def diffusers_model(self):
        from diffusers import WanTransformer3DModel

        m = self.recipe.model
        model = WanTransformer3DModel(**m.diffusers_kwargs())
        model.load_state_dict(self.initial_state)
        if self.recipe.train.recompute != "none":
            model.enable_gradient_checkpointing()
        model = model.to(self.device)
        xt, target, timesteps, text = self.video

        def forward_loss():
            with self._autocast():
                pred = model(xt, timesteps, text, return_dict=False)[0]
            return F.mse_loss(pred.float(), target.float())

        return model, forward_loss, torch.optim.AdamW(model.parameters(), lr=1e-5)

    def ours_model(self, recipe):
        model = WanDiT(recipe.model)
        model.load_state_dict(self.initial_state)
        model.set_recompute(recipe.train.recompute)
        model = model.to(self.device)
        if compiles(recipe, self.device.type):
            import torch._dynamo as dynamo

            dynamo.reset()  # each variant compiles afresh (and stays under the recompile limit)
            model.compile_regions(dynamic=False)  # one pack shape

        def forward_loss():
            with self._autocast():
                pred = model(self.batch)
            return F.mse_loss(pred.float(), self.packed_target.float())

        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=self.device.type == "cuda")
        return model, forward_loss, opt

    # -- timing ----------------------------------------------------------------------------
    @staticmethod
    def _step(forward_loss, opt, clock: _Clock):
        t0 = clock.mark()
        loss = forward_loss()
        t1 = clock.mark()
        loss.backward()
        t2 = clock.mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), (t0, t1, t2, clock.mark())

    def time_run(self, name: str, model, forward_loss, opt) -> RunResult:
        """First step (compiles where compiled), warm-up, then ``steps`` timed steps."""
        clock = _Clock(self.device)
        first, _ = self._step(forward_loss, opt, clock)
        first = float(first)
        for _ in range(max(self.warmup - 1, 0)):
            self._step(forward_loss, opt, clock)
        self.accel.synchronize()
        self.accel.reset_peak_memory_stats()
        marks = []
        t0 = time.perf_counter()
        for _ in range(self.steps):
            loss, step_marks = self._step(forward_loss, opt, clock)
            marks.append(step_marks)
        self.accel.synchronize()
        step_s = (time.perf_counter() - t0) / self.steps
        phases = [sum(clock.seconds(m[i], m[i + 1]) for m in marks) / self.steps for i in range(3)]
        return RunResult(name, step_s, *phases, float(self.accel.memory_stats().peak_allocated), first, float(loss))

    def release(self, model, opt) -> None:
        model.to("cpu")
        del opt
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- diagnostics -----------------------------------------------------------------------
    def profile(self, forward_loss, opt, steps: int = 3, rows: int = 10) -> str:
        """torch.profiler over ``steps`` steps: the top kernels by device time (CUDA only)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                self._step(forward_loss, opt, _Clock(self.device))
            self.accel.synchronize()
        averages = prof.key_averages()
        try:
            return averages.table(sort_by="self_device_time_total", row_limit=rows)
        except (AttributeError, KeyError, ValueError):  # older spelling of the same column
            return averages.table(sort_by="self_cuda_time_total", row_limit=rows)

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


def _loss_agrees(a: float, b: float, dtype: torch.dtype, fp8: bool = False) -> bool:
    """Whether two first-step losses agree: to 1e-4 in fp32, to 5e-2 in bf16 or with FP8 GEMMs."""
    tol = 1e-4 if dtype == torch.float32 and not fp8 else 5e-2
    return abs(a - b) <= tol * max(abs(a), 1e-6)


def run_bench(recipe, steps: int = 10, warmup: int = 3, batch_size: int = 1,
              variants: list[tuple[str, list[str]]] = (),
              profile: bool = True, report: Callable[[str], None] = print) -> dict[str, RunResult]:
    """Time the diffusers step, ours, then each variant of ours; ``report`` gets every line as
    soon as it is known. Raises AssertionError (after reporting everything) when a run's
    first-step loss disagrees with the baseline's."""
    m = recipe.model
    configs = [(name, o, variant_recipe(recipe, o)) for name, o in variants]  # bad overrides fail before any run
    for r in [recipe] + [c for _, _, c in configs]:
        r.model.check_device(get_accelerator().device_type)
    bench = Bench(recipe, steps, warmup, batch_size)
    report(f"latents {batch_size} x {recipe.sample.num_frames}x{recipe.sample.height}x{recipe.sample.width} frames, "
           f"{bench.tokens} tokens/step, {m.num_layers} layers, {bench.device.type} {bench.dtype}")

    fp8_runs = {"loongforge": m.fp8 != "none"}
    fp8_runs.update({name: r.model.fp8 != "none" for name, _, r in configs})

    def agrees(r: RunResult) -> bool:
        """First-step loss as the baseline's, and still finite after the timed steps."""
        finite = math.isfinite(r.last_loss)
        return finite and _loss_agrees(base.first_loss, r.first_loss, bench.dtype, fp8_runs.get(r.name, False))

    def line(r: RunResult, base: RunResult | None) -> str:
        text = (f"{r.name:>10}: {r.step_s * 1e3:8.1f} ms/step {bench.tokens / r.step_s:10.0f} tokens/s  "
                f"peak {r.peak_bytes / 2**30:6.2f} GiB  forward {r.forward_s * 1e3:7.1f}  backward "
                f"{r.backward_s * 1e3:7.1f}  optimizer {r.optimizer_s * 1e3:6.1f} ms  first loss {r.first_loss:.5f}  "
                f"last {r.last_loss:.5f}")
        if base is not None:
            agree = "" if agrees(r) else "  LOSS MISMATCH OR NOT FINITE"
            text += f"  speed-up {base.step_s / r.step_s:.2f}x{agree}"
        return text

    results: dict[str, RunResult] = {}
    model, forward_loss, opt = bench.diffusers_model()
    base = results["diffusers"] = bench.time_run("diffusers", model, forward_loss, opt)
    bench.release(model, opt)
    report(f"  diffusers: eager, SDPA, gradient checkpointing {'on' if recipe.train.recompute != 'none' else 'off'}")
    report(line(base, None))

    model, forward_loss, opt = bench.ours_model(recipe)
    ours = results["loongforge"] = bench.time_run("loongforge", model, forward_loss, opt)
    report(f"  loongforge: {describe(recipe, bench.device.type)}")
    report(line(ours, base))
    report(f"speed-up (diffusers step time / loongforge step time): {base.step_s / ours.step_s:.2f}x")

    if profile and bench.device.type == "cuda":
        try:
            report("loongforge: top CUDA kernels over 3 steps (torch.profiler)")
            report(bench.profile(forward_loss, opt))
        except Exception:
            report("profiler failed (the results above stand):\n" + traceback.format_exc())
        try:
            report(f"self-attention kernels at this shape ({bench.tokens} tokens, fwd+bwd):")
            for name, ms, tflops in bench.attention_kernels():
                report(f"  {name:<24} {ms:8.2f} ms  {tflops:6.0f} TFLOP/s")
        except Exception:
            report("attention-kernel timing failed (the results above stand):\n" + traceback.format_exc())
    bench.release(model, opt)

    for name, overrides, variant in configs:
        try:
            model, forward_loss, opt = bench.ours_model(variant)
            results[name] = bench.time_run(name, model, forward_loss, opt)
            bench.release(model, opt)
            report(f"  {name}: {','.join(overrides)} ({describe(variant, bench.device.type)})")
            report(line(results[name], base))
        except Exception:
            report(f"{name} ({overrides}) failed:\n" + traceback.format_exc())

    bad = [r.name for r in results.values() if not agrees(r)]
    if bad:
        raise AssertionError(f"first-step losses disagree with diffusers ({base.first_loss:.6f}) or the last is not finite: "
                             + ", ".join(f"{n} {results[n].first_loss:.6f} (last {results[n].last_loss:.6f})" for n in bad))
    return results
