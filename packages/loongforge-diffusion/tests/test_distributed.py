"""Parallel layouts give the single-process result: Ulysses CP=2 and DP=2 (FSDP2, packed
micro-batches, core balancer, sharded pretrained load, resume) on 2 gloo processes against 1
process, same data and pretrained weights; Qwen-Image on DP=2 (DDP and FSDP2)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loongforge.core.checkpoint import load_checkpoint
from loongforge.core.metrics import read_metrics
from loongforge.diffusion.cli import main

WORKER = Path(__file__).with_name("distributed_worker.py")
LR = 2e-3


def _compare(run: Path, ref: Path) -> None:
    got, want = read_metrics(run), read_metrics(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
    tg, mg, _ = load_checkpoint(run / "checkpoints")
    tw, _, _ = load_checkpoint(ref / "checkpoints")
    assert set(tg) == set(tw)
    for key in tw:
        if key.startswith("optim."):  # Adam moments: the gradients of both steps
            scale = float(tw[key].abs().max())
            torch.testing.assert_close(tg[key], tw[key], atol=1e-4 * scale, rtol=0, msg=key)
        else:  # weights after two steps; Adam normalises tiny gradients, so allow 5% of one lr step
            torch.testing.assert_close(tg[key], tw[key], atol=0.05 * LR, rtol=0, msg=key)
    return mg


def _launch_worker(tmp_path: Path, args: list[str]) -> subprocess.Popen:
    """``distributed_worker.py`` on 2 gloo processes (it writes its runs under ``tmp_path``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOONGFORGE_ACCELERATOR": "cpu"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
         str(tmp_path), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait(proc: subprocess.Popen) -> None:
    output, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, output[-4000:]


@pytest.mark.slow
def test_cp2_and_fsdp2_dp2_equal_one_process(tmp_path, synthetic_overrides, cache_dir):
    from diffusers import WanTransformer3DModel

    from loongforge.diffusion.model import WanConfig

    torch.manual_seed(11)
    WanTransformer3DModel(**WanConfig().diffusers_kwargs()).save_pretrained(str(tmp_path / "pretrained"))
    common = ["train.steps=3", "train.global_batch_size=6", "train.warmup_steps=0", f"train.lr={LR}",
              "train.lr_decay_style=constant", "checkpoint.interval=2", f"model.pretrained={tmp_path / 'pretrained'}",
              *synthetic_overrides]
    proc = _launch_worker(tmp_path, common)
    ref = tmp_path / "ref"
    assert main(["train", f"log.run_dir={ref}", *common]) == 0  # meanwhile, the 1-process reference
    _wait(proc)

    manifest = _compare(tmp_path / "cp2", ref)
    assert manifest["layout"] == {"dp": 1, "cp": 2, "data_parallel": "ddp", "dp_replicate": 1, "world_size": 2}
    manifest = _compare(tmp_path / "dp2_fsdp2", ref)
    assert manifest["layout"] == {"dp": 2, "cp": 1, "data_parallel": "fsdp", "dp_replicate": 1, "world_size": 2}
    assert max(r["micro_batches"] for r in read_metrics(tmp_path / "dp2_fsdp2")) > 1


@pytest.mark.slow
def test_cp2_equals_one_process_for_image_to_video(tmp_path, synthetic_overrides, cache_dir):
    """Ulysses CP=2 with I2V (each rank's cross-attention reads the image tokens of its samples)
    and TI2V (each rank embeds the distinct timesteps of its own tokens) gives the 1-process run."""
    configs = ["tiny_i2v", "tiny_ti2v"]
    common = ["train.steps=3", "train.global_batch_size=6", "train.warmup_steps=0", f"train.lr={LR}",
              "train.lr_decay_style=constant", "checkpoint.interval=2", *synthetic_overrides]
    proc = _launch_worker(tmp_path, [f"--cp2-config={c}" for c in configs] + common)
    for config in configs:  # meanwhile, the 1-process references
        assert main(["train", "--config", config, f"log.run_dir={tmp_path / f'ref_{config}'}", *common]) == 0
    _wait(proc)
    for config in configs:
        manifest = _compare(tmp_path / f"cp2_{config}", tmp_path / f"ref_{config}")
        assert manifest["layout"]["cp"] == 2


@pytest.mark.slow
@pytest.mark.long  # two 2-process runs and a reference: minutes on 2 CPU cores (the Wan tests above cover the machinery)
def test_qwen_image_dp2_ddp_and_fsdp2_equal_one_process(tmp_path, synthetic_overrides, cache_dir):
    """Qwen-Image's frozen last-block prompt tail leaves every trainable parameter used: DDP and
    FSDP2 over 2 processes give the 1-process run."""
    common = ["train.steps=3", "train.global_batch_size=4", "train.warmup_steps=0", f"train.lr={LR}",
              "train.lr_decay_style=constant", "checkpoint.interval=3", *synthetic_overrides]
    proc = _launch_worker(tmp_path, ["--dp2-config=qwen_image_debug", *common])
    ref = tmp_path / "ref"
    assert main(["train", "--config", "qwen_image_debug", f"log.run_dir={ref}", *common]) == 0
    _wait(proc)
    for name, data_parallel in (("ddp2", "ddp"), ("fsdp2", "fsdp")):
        manifest = _compare(tmp_path / f"{name}_qwen_image_debug", ref)
        assert manifest["layout"]["dp"] == 2 and manifest["layout"]["data_parallel"] == data_parallel
