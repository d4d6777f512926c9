"""``train.offload_layers`` through the CLIs: on the megatron-core engine (``lf-llm``, ``lf-vlm``) and the
PyTorch-native one (``lf-diffusion``), a run with the first block's activations offloaded logs the
same losses and gradient norms as the run without, and how much it moved (``offload_gib``)."""

from __future__ import annotations

import json

import pytest

from loongforge.diffusion.cli import main as lf_diffusion
from loongforge.llm.cli import main as lf_llm
from loongforge.vlm.cli import main as lf_vlm

COMMON = ["train.steps=2", "train.global_batch_size=4", "log.interval=1", "checkpoint.save=false", "log.progress=false"]
CLIS = {"lf-llm": (lf_llm, []), "lf-vlm": (lf_vlm, []), "lf-diffusion": (lf_diffusion, ["data.synthetic_clips=8"])}


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cli", list(CLIS))
def test_offloaded_run_logs_the_same_losses_and_grad_norms(cli, tmp_path):
    main, own = CLIS[cli]
    assert main(["train", *COMMON, *own, f"log.run_dir={tmp_path / 'plain'}"]) == 0
    assert main(["train", *COMMON, *own, "train.offload_layers=1", f"log.run_dir={tmp_path / 'offload'}"]) == 0
    plain, offloaded = metrics(tmp_path / "plain"), metrics(tmp_path / "offload")
    assert len(plain) == 2 and len(offloaded) == 2
    for a, b in zip(plain, offloaded):
        assert (b["loss"], b["grad_norm"]) == (a["loss"], a["grad_norm"])
        assert "offload_gib" not in a and b["offload_gib"] > 0  # the first block's activations did move


def test_offload_with_full_recompute_is_one_error_line(tmp_path, capsys):
    capsys.readouterr()
    assert lf_llm(["train", "train.offload_layers=1", "train.recompute=full", f"log.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "train.offload_layers=1" in err[0], err
