"""``lf-diffusion bench``: our training step against a plain diffusers training step, side by side
in one process on the same config, weights and data.

The baseline is what a diffusers training script does: ``WanTransformer3DModel`` (eager, SDPA
attention) on a ``[B, C, F, H, W]`` batch, MSE to the velocity, backward, AdamW. Ours is the
LoongForge step: the packed ``WanDiT`` (attention backend, fused kernels from the registry)
with the same objective. Both use bf16 autocast on GPUs (fp32 on CPU) and the model's activation
checkpointing setting. The first-step losses of the two are checked to agree before timing.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from loongforge.core.accelerators import get_accelerator
from loongforge.diffusion.model import WanDiT
from loongforge.diffusion.objective import noisy_and_target
from loongforge.diffusion.packing import num_tokens, pack, pack_targets


def _latent_shape(recipe) -> tuple[int, int, int, int]:
    s, m = recipe.sample, recipe.model
    return (m.in_channels, 1 + (s.num_frames - 1) // 4, s.height // 8, s.width // 8)


def run_bench(recipe, steps: int = 10, warmup: int = 3, batch_size: int = 1) -> dict[str, float]:
    """Seconds per training step of both, tokens/s and the speed-up (baseline / ours)."""
    from diffusers import WanTransformer3DModel

    accel = get_accelerator()
    device = accel.device()
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    m = recipe.model
    torch.manual_seed(recipe.train.seed)
    ours = WanDiT(m).to(device)
    base = WanTransformer3DModel(**m.diffusers_kwargs()).to(device)
    base.load_state_dict(ours.state_dict())
    if m.activation_checkpointing:
        base.enable_gradient_checkpointing()

    shape = _latent_shape(recipe)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn((batch_size, *shape), generator=g)
    noise = torch.randn((batch_size, *shape), generator=g)
    sigma = torch.rand(batch_size, generator=g)
    text = torch.randn(batch_size, m.text_len, m.text_dim, generator=g)
    pairs = [noisy_and_target(x0[i], noise[i], sigma[i].item()) for i in range(batch_size)]
    xt = torch.stack([p[0] for p in pairs])
    target = torch.stack([p[1] for p in pairs])
    timesteps = sigma * recipe.objective.num_train_timesteps
    batch = pack(list(xt), timesteps, text, m.patch_size).to(device)
    packed_target = pack_targets(list(target), m.patch_size).to(device)
    xt, target, timesteps, text = xt.to(device), target.to(device), timesteps.to(device), text.to(device)

    def ours_step(opt):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            pred = ours(batch)
        loss = F.mse_loss(pred.float(), packed_target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def base_step(opt):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            pred = base(xt, timesteps, text, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    results = {}
    for name, model, step_fn in (("diffusers", base, base_step), ("loongforge", ours, ours_step)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        first = step_fn(opt)
        results[f"{name}_first_loss"] = float(first)
        for _ in range(max(warmup - 1, 0)):
            step_fn(opt)
        accel.synchronize()
        accel.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step_fn(opt)
        accel.synchronize()
        results[f"{name}_step_s"] = (time.perf_counter() - t0) / steps
        results[f"{name}_peak_bytes"] = float(accel.memory_stats().peak_allocated)
        model.to("cpu")  # free the device for the other one
        del opt
    a, b = results["diffusers_first_loss"], results["loongforge_first_loss"]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if abs(a - b) > tol * max(abs(a), 1e-6):
        raise AssertionError(f"first-step losses disagree: diffusers {a:.6f} vs loongforge {b:.6f}")
    tokens = batch_size * num_tokens(shape, m.patch_size)
    results["tokens_per_step"] = float(tokens)
    results["diffusers_tokens_per_s"] = tokens / results["diffusers_step_s"]
    results["loongforge_tokens_per_s"] = tokens / results["loongforge_step_s"]
    results["speedup"] = results["diffusers_step_s"] / results["loongforge_step_s"]
    return results
