"""Run under ``torchrun --nproc-per-node 2``: the PyTorch-native engine's forward/backward under
DDP, FSDP2, HSDP (and FSDP2 with activation recomputation, in bf16, and with LoRA adapters) against
one process on the whole batch, then a run checkpointed under FSDP2 and resumed under DDP (also
with LoRA). Rank 0 writes ``results.json`` into the directory given as argv[1]."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
os.environ.setdefault("LOONGFORGE_ACCELERATOR", "cpu")

from embodied_helpers import LORA_OVERRIDES  # noqa: E402
from loongforge.core.lora import LoRAConfig, LoRALinear, apply_lora  # noqa: E402
from loongforge.core.parallel import init_parallel  # noqa: E402
from loongforge.core.training.run import run_training  # noqa: E402
from loongforge.core.training.schema import ParallelConfig, TrainConfig  # noqa: E402
from loongforge.core.training.task import StepBatch  # noqa: E402
from loongforge.core.training.torch_engine import TorchEngine  # noqa: E402
from loongforge.embodied.config import EmbodiedConfig, load_train_config  # noqa: E402
from loongforge.embodied.policies import build_policy, policy_config  # noqa: E402
from loongforge.embodied.task import PolicyTask, loss_mask  # noqa: E402

B, CHUNK, ADIM, SIZE = 4, 4, 3, 16
MODES = {  # (parallel, train) of the engine; seed 0 builds the reference's initial weights
    "ddp": (ParallelConfig(data_parallel="ddp"), TrainConfig(seed=0)),
    "fsdp": (ParallelConfig(data_parallel="fsdp"), TrainConfig(seed=0)),
    "hsdp": (ParallelConfig(data_parallel="hsdp", dp_replicate=2), TrainConfig(seed=0)),
    "fsdp_ac": (ParallelConfig(data_parallel="fsdp"), TrainConfig(seed=0, recompute="full")),
    "fsdp_bf16": (ParallelConfig(data_parallel="fsdp"), TrainConfig(seed=0, precision="bf16")),
    "fsdp_lora": (ParallelConfig(data_parallel="fsdp"), TrainConfig(seed=0, recompute="full")),
}
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "fc1", "re:.*_attn\\.(q|out)"])


def global_batch():
    g = torch.Generator().manual_seed(5)
    pad = torch.zeros(B, CHUNK, dtype=torch.bool)
    pad[0, 2:] = True  # rank 0's rows hold fewer valid steps than rank 1's
    pad[1, 3:] = True
    batch = {
        "images": torch.rand(B, 2, 3, SIZE, SIZE, generator=g) * 2 - 1,
        "image_mask": torch.tensor([[True, True], [True, False], [True, True], [False, True]]),
        "tokens": torch.randint(4, 500, (B, 10), generator=g),
        "token_mask": torch.arange(10)[None] < torch.tensor([[10], [6], [8], [3]]),
        "state": torch.randn(B, ADIM, generator=g),
        "actions": torch.randn(B, CHUNK, ADIM, generator=g),
        "action_is_pad": pad,
        "action_dim_mask": torch.tensor([True, True, False])[None].expand(B, ADIM),
    }
    return batch, torch.randn(B, CHUNK, ADIM, generator=g), torch.rand(B, generator=g)


def full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


@torch.no_grad()
def lora_b_init(model):
    """B = 0.01 * (row + col) for every adapter: a gradient for A too, the same on any sharding."""
    from loongforge.core.training.sharding import local, region

    for m in model.modules():
        if isinstance(m, LoRALinear):
            b = m.lora_B.weight
            whole = 0.01 * (torch.arange(m.out_features)[:, None] + torch.arange(m.rank)[None]).float()
            offset, shape = region(b)
            local(b).copy_(whole[offset[0]:offset[0] + shape[0]])


def equivalence(ctx, name):
    """One forward/backward of the engine in each mode (this rank's rows of the global batch)
    against one process on the whole batch."""
    cfg = policy_config(name, chunk_size=CHUNK, max_action_dim=ADIM, max_state_dim=ADIM, num_cameras=2, image_size=SIZE)
    batch, noise, t = global_batch()
    torch.manual_seed(0)
    ref = build_policy(cfg)
    per = ref(batch, noise, t)
    mask = loss_mask(batch)
    ref_loss = (per * mask).sum() / mask.sum()
    ref_loss.backward()
    ref_grads = full_grads(ref)
    rows = slice(ctx.rank * B // ctx.world_size, (ctx.rank + 1) * B // ctx.world_size)
    local = {k: v[rows] for k, v in batch.items()}
    local.update(noise=noise[rows], time=t[rows])
    # the LoRA reference: the same weights and adapters (B = 0 gives A no gradient: B starts nonzero here)
    torch.manual_seed(0)
    lora_ref = build_policy(cfg)
    apply_lora(lora_ref, LORA, seed=0)
    lora_b_init(lora_ref)
    per = lora_ref(batch, noise, t)
    lora_loss = (per * mask).sum() / mask.sum()
    lora_loss.backward()
    lora_grads = full_grads(lora_ref)
    result = {}
    for mode, (parallel, train) in MODES.items():
        run = EmbodiedConfig(model=cfg, parallel=parallel, train=train)
        lora = LORA if mode.endswith("lora") else None
        # builds after torch.manual_seed(train.seed=0), as ref
        engine = TorchEngine(PolicyTask(run), ctx, train, parallel, lora=lora)
        want_loss, want_grads = ref_loss, ref_grads
        if lora is not None:
            lora_b_init(engine.model)
            want_loss, want_grads = lora_loss, lora_grads
        out = engine.forward_backward(StepBatch(micro_batches=[local]))
        grads = full_grads(engine.model)
        assert set(grads) == set(want_grads), (mode, set(grads) ^ set(want_grads))
        # |g - g_ref| <= atol + rtol * |g_ref| elementwise, i.e. torch.testing.assert_close(rtol=1e-4, atol=1e-7);
        # the atol covers gradients that are exactly zero in exact arithmetic (attention key biases)
        flat = torch.cat([grads[k].flatten() - want_grads[k].flatten() for k in grads])
        rel_l2 = float(flat.norm() / torch.cat([want_grads[k].flatten() for k in grads]).norm())
        worst = max(float(((grads[k] - want_grads[k]).abs() / (1e-7 + 1e-4 * want_grads[k].abs())).max()) for k in grads)
        result[mode] = {"loss": out.loss, "ref_loss": float(want_loss.detach()), "grad_violation": worst,
                        "grad_rel_l2": rel_l2, "num_grads": len(grads)}
    return result


def resume_across_layouts(dataset_root, run_dir, *extra):
    base = [*extra, f"data.path={dataset_root}", "data.repo_id=local/tiny", f"log.run_dir={run_dir}", "model.image_size=16",
            "model.chunk_size=4", "model.max_state_dim=4", "model.max_action_dim=4", "train.global_batch_size=4",
            "log.progress=false", "log.tensorboard=false", "checkpoint.interval=2", "log.interval=1"]

    def train(overrides):
        cfg = load_train_config("train", base + overrides)
        return run_training(cfg, PolicyTask(cfg), "lf-embodied")

    first = train(["train.steps=2", "parallel.data_parallel=fsdp"])
    second = train(["train.steps=4", "parallel.data_parallel=ddp"])
    return {"first": [r.loss for r in first.results], "second": [r.loss for r in second.results],
            "second_start": second.start_step}


def main():
    out = Path(sys.argv[1])
    ctx = init_parallel(seed=1234)
    results = {name: equivalence(ctx, name) for name in ("pi0", "pi05", "groot")}
    results["resume"] = resume_across_layouts(sys.argv[2], out / "run")
    results["resume_lora"] = resume_across_layouts(sys.argv[2], out / "run_lora", *LORA_OVERRIDES)
    if ctx.is_main:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
