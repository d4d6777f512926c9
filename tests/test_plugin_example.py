"""A downstream team adds a model part without touching LoongForge: ``tests/plugin_example`` is an
out-of-tree package with a VLM vision encoder, a robot policy and a diffusion transformer, one
module each, registered by entry points (a ``.dist-info`` on ``PYTHONPATH``), trained by the stock
``lf-vlm``, ``lf-embodied`` and ``lf-diffusion`` from a YAML of their own; the VLM encoder's
Hugging Face layout (``loongforge.vlm.hf_layouts``) converts through the stock ``lf-vlm convert``
both ways."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cli_runner import run_cli
from loongforge.core.checkpoint import Checkpoint

pytestmark = pytest.mark.slow

PLUGIN = Path(__file__).parent / "plugin_example"


# the lf-embodied plugin under -m long (CI's 20 minutes): the lf-vlm one runs the same entry-point path
@pytest.mark.parametrize(("cli", "config", "part"), [
    ("lf-vlm", "vlm_plain_vit.yaml", ("encoder", "plain_vit")),
    ("lf-diffusion", "diffusion_mlp_dit.yaml", ("model", "mlp_dit")),
    pytest.param("lf-embodied", "embodied_mlp_policy.yaml", ("model", "mlp_policy"), marks=pytest.mark.long)])
def test_a_plugin_part_trains_from_the_stock_cli(cli, config, part, tmp_path):
    run = tmp_path / "run"
    proc = run_cli([cli, "train", "--config", str(PLUGIN / "configs" / config), f"log.run_dir={run}", "log.interval=1",
                    "log.progress=false", "log.tensorboard=false"], env={"PYTHONPATH": str(PLUGIN)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    section, family = part
    manifest = Checkpoint(run / "checkpoints").manifest
    assert manifest["config"][section]["family"] == family
    info = run_cli([cli, "info", "--config", str(PLUGIN / "configs" / config)], env={"PYTHONPATH": str(PLUGIN)})
    assert info.returncode == 0 and family in info.stdout, info.stderr[-3000:]
    if cli == "lf-vlm":
        _converts_through_its_layout(run / "checkpoints", tmp_path)


def _converts_through_its_layout(checkpoints: Path, tmp_path: Path) -> None:
    """The trained plugin model to its HF layout and back: the same tensors, the plugin's architecture."""
    env = {"PYTHONPATH": str(PLUGIN)}
    proc = run_cli(["lf-vlm", "convert", "lf-to-hf", str(checkpoints), str(tmp_path / "hf")], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["PlainViTForConditionalGeneration"]
    proc = run_cli(["lf-vlm", "convert", "hf-to-lf", str(tmp_path / "hf"), str(tmp_path / "back")], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained, back = Checkpoint(checkpoints), Checkpoint(tmp_path / "back")
    weights = sorted(k for k in trained.reader.keys() if not k.startswith("optimizer."))
    assert sorted(back.reader.keys()) == weights
    for key in weights:
        assert torch.equal(back.tensor(key), trained.tensor(key)), key
