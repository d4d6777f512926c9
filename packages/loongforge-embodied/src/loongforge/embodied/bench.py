"""Training-step throughput (samples/s) of a policy, and of LeRobot's own Pi0.5 for the same
config, batch and image size, in the same process (``lf-embodied bench``).

Both sides get the same preprocessed synthetic batch (cameras in [-1, 1], full-length prompts,
padded state/actions), run forward + backward + AdamW, and are timed after warm-up with the
accelerator synchronised. LeRobot's ``PI05Pytorch`` constructor builds only the released sizes
(``gemma_2b`` + ``gemma_300m``), so the comparison needs ``policy=pi05_base``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn as nn

from loongforge.core.training import torch_parallel
from loongforge.core.training.engine import resolve_dtype
from loongforge.core.training.schema import TrainConfig
from loongforge.embodied.config import PolicyConfig


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


def samples_per_second(step: Callable[[], None], batch_size: int, steps: int, warmup: int, synchronize: Callable[[], None]) -> float:
    for _ in range(warmup):
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    return batch_size * steps / (time.perf_counter() - start)


def loongforge_step(policy: nn.Module, train: TrainConfig, device: torch.device, batch: dict,
                    lr: float = 1e-5) -> Callable[[], None]:
    """Our training step as the engine runs it on one process: ``train.recompute``, regional
    compilation per ``train.compile`` (null: on CUDA), autocast per ``train.precision``, AdamW (fused on CUDA)."""
    model = policy.to(device)
    model.set_recompute(train.recompute)
    if train.compile if train.compile is not None else device.type == "cuda":
        for block in model.repeated_blocks():
            block.compile()
    model.train()
    dtype = resolve_dtype(train.precision, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=device.type == "cuda")

    def step():
        with torch_parallel.autocast(device.type, dtype):
            loss = model(batch, batch["noise"], batch["time"]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def lerobot_step(model: nn.Module, batch: dict, lr: float = 1e-5) -> Callable[[], None]:
    """A training step of LeRobot's ``PI05Pytorch`` (``forward`` returns per-element losses)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    images, masks = list(batch["images"].unbind(1)), list(batch["image_mask"].unbind(1))

    def step():
        loss = model.forward(images, masks, batch["tokens"], batch["token_mask"], batch["actions"], batch["noise"], batch["time"]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_lerobot_pi05_released(cfg: PolicyConfig, dtype: str = "bfloat16", compile_model: bool = False) -> nn.Module:
    """LeRobot's ``PI05Pytorch`` at the released size, with ``cfg``'s chunk, padding and image size."""
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    released = (cfg.vlm.width, cfg.vlm.depth, cfg.expert.width, cfg.vision.hidden_size, cfg.vision.num_layers)
    if released != (2048, 18, 1024, 1152, 27) or cfg.vocab_size != 257152:
        raise ValueError("LeRobot builds Pi0.5 only at its released size: use policy=pi05_base for --against-lerobot")
    return PI05Pytorch(PI05Config(
        dtype=dtype, chunk_size=cfg.chunk_size, n_action_steps=cfg.chunk_size, max_state_dim=cfg.max_state_dim,
        max_action_dim=cfg.max_action_dim, image_resolution=(cfg.image_size, cfg.image_size), compile_model=compile_model,
    ))
