"""Run under ``torchrun --nproc-per-node 2``: DDP, FSDP2, HSDP (and FSDP2 with activation
checkpointing) against one process on the whole batch, then a run checkpointed under FSDP2 and
resumed under DDP. Rank 0 writes ``results.json`` into the directory given as argv[1]."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
os.environ.setdefault("LOONGFORGE_ACCELERATOR", "cpu")

from loongforge.core.distributed import init_distributed  # noqa: E402
from loongforge.embodied.config import ParallelConfig, PolicyConfig, load_train_config  # noqa: E402
from loongforge.embodied.parallel import parallelize, unwrap  # noqa: E402
from loongforge.embodied.policies.registry import build_policy  # noqa: E402
from loongforge.embodied.trainer import distributed_loss, loss_mask, train  # noqa: E402

B, CHUNK, ADIM, SIZE = 4, 4, 3, 16
MODES = {
    "ddp": ParallelConfig(mode="ddp"),
    "fsdp": ParallelConfig(mode="fsdp"),
    "hsdp": ParallelConfig(mode="hsdp", dp_replicate=2),
    "fsdp_ac": ParallelConfig(mode="fsdp", activation_checkpointing=True),
    "fsdp_bf16": ParallelConfig(mode="fsdp", param_dtype="bf16", reduce_dtype="fp32"),
}


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
    for name, p in unwrap(model).named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def equivalence(env, name):
    cfg = PolicyConfig(name=name, chunk_size=CHUNK, max_action_dim=ADIM, max_state_dim=ADIM, num_cameras=2, image_size=SIZE)
    batch, noise, t = global_batch()
    torch.manual_seed(0)
    ref = build_policy(cfg)
    per = ref(batch, noise, t)
    mask = loss_mask(batch)
    ref_loss = (per * mask).sum() / mask.sum()
    ref_loss.backward()
    ref_grads = full_grads(ref)
    rows = slice(env.rank * B // env.world_size, (env.rank + 1) * B // env.world_size)
    local = {k: v[rows] for k, v in batch.items()}
    result = {}
    for mode, pcfg in MODES.items():
        torch.manual_seed(0)
        model = parallelize(build_policy(cfg), pcfg, env)
        loss, mean = distributed_loss(model, local, noise[rows], t[rows], env.world_size)
        loss.backward()
        grads = full_grads(model)
        assert set(grads) == set(ref_grads), (mode, set(grads) ^ set(ref_grads))
        # |g - g_ref| <= atol + rtol * |g_ref| elementwise, i.e. torch.testing.assert_close(rtol=1e-4, atol=1e-7);
        # the atol covers gradients that are exactly zero in exact arithmetic (attention key biases)
        flat = torch.cat([grads[k].flatten() - ref_grads[k].flatten() for k in grads])
        rel_l2 = float(flat.norm() / torch.cat([ref_grads[k].flatten() for k in grads]).norm())
        worst = max(float(((grads[k] - ref_grads[k]).abs() / (1e-7 + 1e-4 * ref_grads[k].abs())).max()) for k in grads)
        result[mode] = {"loss": float(mean), "ref_loss": float(ref_loss.detach()), "grad_violation": worst,
                        "grad_rel_l2": rel_l2, "num_grads": len(grads)}
    return result


def resume_across_layouts(dataset_root, run_dir):
    base = [f"dataset.root={dataset_root}", "dataset.repo_id=local/tiny", f"run_dir={run_dir}", "policy.image_size=16",
            "policy.chunk_size=4", "policy.max_state_dim=4", "policy.max_action_dim=4", "batch_size=4",
            "progress=false", "tensorboard=false", "save_every=2", "log_every=1"]
    first = train(load_train_config("train", base + ["steps=2", "parallel.mode=fsdp"]))
    second = train(load_train_config("train", base + ["steps=4", "parallel.mode=ddp"]))
    return {"first": first.losses, "second": second.losses, "second_start": second.start_step}


def main():
    out = Path(sys.argv[1])
    env = init_distributed(group_for_world_of_one=False)
    results = {name: equivalence(env, name) for name in ("pi05", "groot")}
    results["resume"] = resume_across_layouts(sys.argv[2], out / "run")
    if env.is_main:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
