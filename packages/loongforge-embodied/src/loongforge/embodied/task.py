"""Flow-matching policy training on a LeRobot dataset, as a task of the shared loop (PyTorch-native
engine: DDP / FSDP2 / HSDP).

Per step: this DP rank's slice of global batch ``s`` (``StepBatchSampler``), split into
micro-batches of ``train.micro_batch_size`` samples (null: one), with the noise and times of
global batch ``s`` (``draw_noise_and_time``: a function of (seed, step), so any split and any
resume see the same values). The loss is the per-element flow-matching error masked to real
action dimensions and in-episode chunk steps; the loop normalises it by the global number of
valid elements. Every policy family (``Pi0Config``, ``Pi05Config``, ``SmolVLAConfig``, ``GrootN17Config``...) trains through this task.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from loongforge.core.config import to_dict
from loongforge.core.training.sharding import local, region
from loongforge.core.training.task import StepBatch, TorchTask
from loongforge.embodied.config import EmbodiedConfig
from loongforge.embodied.data.dataset import EmbodiedDataset
from loongforge.embodied.data.sampler import StepBatchSampler
from loongforge.embodied.data.synthetic import ensure_synthetic_dataset
from loongforge.embodied.policies.flow_matching import draw_noise_and_time

# policy fields that do not change the model (where its first weights came from)
NOT_ARCHITECTURE = ("pretrained", "pretrained_format", "tokenizer")
# data fields that do not change what a step trains on
NOT_DATA = ("root", "num_workers", "video_backend")


def loss_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, chunk, A]`` float: in-episode chunk steps x real action dimensions."""
    return ((~batch["action_is_pad"])[:, :, None] & batch["action_dim_mask"][:, None, :]).float()


def masked_flow_loss(batch: dict[str, torch.Tensor], per_element: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the valid elements' errors, their number)``."""
    mask = loss_mask(batch)
    return (per_element * mask).sum(), mask.sum()


def resolve_dataset_root(root: str | None, is_main: bool) -> str:
    """``data.path``, or the synthetic demo dataset (written by the main rank on first use)."""
    if root is not None:
        return root
    if is_main:
        ensure_synthetic_dataset()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return str(ensure_synthetic_dataset())


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def read_pretrained(cfg) -> dict[str, torch.Tensor]:
    """``model.pretrained`` in LoongForge names (the family's LeRobot layout mapped when asked)."""
    path = Path(cfg.pretrained)
    if not path.is_file():
        raise FileNotFoundError(f"model.pretrained={str(path)!r}: no such file")
    state = load_file(str(path))
    if cfg.pretrained_format == "lerobot":
        from loongforge.embodied.convert.lerobot_layout import from_lerobot, lerobot_adapter

        adapter = lerobot_adapter(cfg.family)
        if adapter is None:
            raise ValueError(f"model.pretrained_format=lerobot: the {cfg.family!r} family has no LeRobot layout mapping")
        with torch.device("meta"):  # names only
            from loongforge.core.models import get_model_spec

            outside = [n for n in get_model_spec(cfg.family).build(cfg).state_dict() if not adapter.covers(n)]
        if outside:
            raise ValueError(f"model.pretrained_format=lerobot: the {cfg.family} family's LeRobot layout covers "
                             f"only part of the policy ({len(outside)} tensors outside it, e.g. {outside[0]}); "
                             f"a LeRobot file cannot start the whole policy")
        state = from_lerobot(adapter, state, cfg, source=f"model.pretrained={str(path)!r}")
    return state


@torch.no_grad()
def load_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy full tensors into ``model``'s (whole or FSDP2-sharded) tensors; every key must match
    (LoRA adapters, ``loongforge.core.lora``, are not the pretrained weights' and stay as they are)."""
    from loongforge.core.lora import strip_adapters

    ours = strip_adapters(model.state_dict())
    missing, unexpected = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
    if missing or unexpected:
        raise KeyError(f"{source}: missing {missing[:5]}..., unexpected {unexpected[:5]}... "
                       f"({len(missing)} missing, {len(unexpected)} unexpected)")
    for key, target in ours.items():
        offset, shape = region(target)
        if shape and shape[0] == 0:
            continue
        value = state[key][offset[0]:offset[0] + shape[0]] if shape else state[key]
        if tuple(value.shape) != tuple(local(target).shape):
            raise ValueError(f"{source}: {key} has shape {tuple(state[key].shape)}, the policy's is {tuple(target.shape)}")
        local(target).copy_(value.to(local(target).dtype))


class PolicyTask(TorchTask):
    variable_micro_batches = False
    model_section = "model"

    def __init__(self, cfg: EmbodiedConfig) -> None:
        self.cfg = cfg
        self.family = cfg.model.family
        self.dataset: EmbodiedDataset | None = None

    @property
    def has_pretrained(self) -> bool:
        return self.cfg.model.pretrained is not None

    def describe(self) -> str:
        return f"{self.family} policy"

    # -- data ---------------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        root = resolve_dataset_root(self.cfg.data.path, ctx.is_main)
        self.dataset = EmbodiedDataset(self.cfg.data, self.cfg.model, root, "train")

    def steps(self, ctx, start_step: int):
        cfg = self.cfg
        train, p = cfg.train, cfg.model
        if train.global_batch_size % ctx.dp_size:
            raise ValueError(f"train.global_batch_size={train.global_batch_size} is not divisible by the "
                             f"{ctx.dp_size} data-parallel ranks")
        per_rank = train.global_batch_size // ctx.dp_size
        micro = train.micro_batch_size or per_rank
        assert self.dataset is not None  # opened by prepare, which runs first
        if per_rank % micro:
            raise ValueError(f"train.micro_batch_size={micro} does not divide a rank's {per_rank} samples per step")
        sampler = StepBatchSampler(len(self.dataset), train.global_batch_size, ctx.dp_rank, ctx.dp_size, train.seed,
                                   start_step=start_step)
        loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=cfg.data.num_workers,
                            pin_memory=ctx.device.type == "cuda")
        rows = slice(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank)
        for step, batch in enumerate(loader, start=start_step):
            noise, t = draw_noise_and_time(train.seed, step, (train.global_batch_size, p.chunk_size, p.max_action_dim),
                                           **p.time_kwargs())
            batch = {**batch, "noise": noise[rows], "time": t[rows]}
            yield StepBatch(micro_batches=[to_device({k: v[i:i + micro] for k, v in batch.items()}, ctx.device)
                                           for i in range(0, per_rank, micro)])

    def manifest_fields(self) -> dict:
        return {"dataset": {**asdict(self.dataset.spec), "root": str(self.dataset.meta.root)}} if self.dataset else {}

    def check_resume(self, manifest: dict) -> None:
        saved, now = manifest["config"], to_dict(self.cfg)
        diff = sorted(f"data.{k}" for k in set(saved["data"]) | set(now["data"])
                      if k not in NOT_DATA and saved["data"].get(k) != now["data"].get(k))
        if diff:
            raise ValueError(f"the run's {', '.join(diff)} differ from the checkpoint's")

    # -- model --------------------------------------------------------------------------------
    def model_config_dict(self) -> dict:
        return {k: v for k, v in to_dict(self.cfg.model).items() if k not in NOT_ARCHITECTURE}

    def build_model(self, ctx) -> torch.nn.Module:
        from loongforge.core.models import get_model_spec

        return get_model_spec(self.family).build(self.cfg.model)

    def load_pretrained(self, model: torch.nn.Module) -> None:
        load_state_into(model, read_pretrained(self.cfg.model), f"model.pretrained={self.cfg.model.pretrained!r}")

    def forward(self, model, batch: dict):
        per_element = model(batch, batch["noise"], batch["time"])
        return per_element, lambda out: masked_flow_loss(batch, out)

    def evaluate(self, model, ctx) -> dict[str, float]:
        """``eval.hook`` on the current weights (every rank runs it: FSDP2 gathers collectively)."""
        from loongforge.embodied.evaluation import get_eval_hook

        was_training = model.training
        try:
            return get_eval_hook(self.cfg.eval.hook)(model, self.cfg, ctx.device)
        finally:
            model.train(was_training)
