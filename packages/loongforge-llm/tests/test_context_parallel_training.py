"""parallel.cp=2 (two processes, gloo, fp32) trains like one process: the same losses and, after
the first step, the same gradient of every parameter (``cp_probe.py``), for pre-training rows and
for packed SFT rows of conversations of uneven lengths."""

from pathlib import Path

import pytest
import torch
from cli_runner import run_script

PROBE = Path(__file__).with_name("cp_probe.py")
COMMON = ["train.steps=2", "train.warmup_steps=1", "log.progress=false", "log.tensorboard=false",
          "checkpoint.save=false"]
PRETRAIN = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=64"]
# 8 conversations a step, packed into rows of up to 256 positions (several conversations each)
SFT = ["train.global_batch_size=8", "train.seq_length=256"]


def probe(out: Path, config: str, overrides: list[str], cache: Path, nproc: int = 1) -> dict:
    args = [str(out), config, *COMMON, f"data.cache_dir={cache}", f"log.run_dir={out.parent / 'run'}", *overrides]
    proc = run_script(PROBE, args, nproc=nproc, env={"LOONGFORGE_ACCELERATOR": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def assert_same_training(got: dict, want: dict) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-4)
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)
    assert sorted(got["grads"]) == sorted(want["grads"]) and want["grads"]
    for name, ref in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("llm-data")


@pytest.mark.slow
def test_pretraining_cp2_matches_one_process(tmp_path, data_cache):
    want = probe(tmp_path / "cp1" / "grads.pt", "train_debug", PRETRAIN, data_cache)
    got = probe(tmp_path / "cp2" / "grads.pt", "train_debug", [*PRETRAIN, "parallel.cp=2"], data_cache, nproc=2)
    assert_same_training(got, want)
    b, s = want["first_tokens_shape"]
    assert got["first_tokens_shape"] == (b, s // 2)  # each CP rank holds half of every row


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded-rows"])
def test_sft_cp2_matches_one_process(packing, tmp_path, data_cache):
    """Conversations of uneven lengths: packed, each padded to a multiple of 2*cp and split per
    segment; unpacked, rows padded to a multiple of 2*cp (the pads train nothing either way)."""
    sft = [*SFT, f"sft.packing={str(packing).lower()}"]
    want = probe(tmp_path / "cp1" / "grads.pt", "sft_debug", sft, data_cache)
    got = probe(tmp_path / "cp2" / "grads.pt", "sft_debug", [*sft, "parallel.cp=2"], data_cache, nproc=2)
    assert_same_training(got, want)
    (b, s), (b2, s2) = want["first_tokens_shape"], got["first_tokens_shape"]
    assert b2 == b and s // 2 <= s2 < s  # half the padded row: the conversations were split
