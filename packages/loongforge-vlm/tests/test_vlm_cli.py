"""``lf-vlm`` end to end on the shipped shapes set: training, exact resume, and swapping a part of
the composition by changing one line of the config."""

import json
import sys
from pathlib import Path

import pytest

from loongforge.vlm.recipe import CONFIG_DIR

FAST = ["train.global_batch_size=4", "train.warmup_steps=1", "log.interval=1", "log.progress=false",
        "log.tensorboard=false"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def manifest(run_dir: Path) -> dict:
    root = run_dir / "checkpoints"
    return json.loads((root / (root / "latest").read_text().strip() / "manifest.json").read_text())


@pytest.mark.slow
def test_train_end_to_end_and_exact_resume(tmp_path, vlm_cache):
    from cli_runner import run_cli

    first = tmp_path / "first"
    proc = run_cli(["lf-vlm", "train", *FAST, "train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=2",
                    f"data.cache_dir={vlm_cache}", f"log.run_dir={first}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ref = metrics(first)
    assert [m["step"] for m in ref] == [1, 2, 3, 4]
    assert ref[-1]["loss"] < ref[0]["loss"]
    record = manifest(first)
    assert record["family"] == "vlm" and record["model_config"]["encoder"]["kind"] == "qwen2_5_vit"

    # resume from the step-2 checkpoint of the first run: steps 3 and 4 again, bit for bit
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "step_00000002").symlink_to(first / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    proc = run_cli(["lf-vlm", "train", *FAST, "train.steps=4", "checkpoint.save=false",
                    f"data.cache_dir={vlm_cache}", f"log.run_dir={resumed}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    again = metrics(resumed)
    assert [m["step"] for m in again] == [3, 4]
    assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in ref[2:]], rel=1e-6)
    assert [m["grad_norm"] for m in again] == pytest.approx([m["grad_norm"] for m in ref[2:]], rel=1e-6)


SWAPS = {
    "foundation-llama": ("  - foundation: qwen2_debug", "  - foundation: llama_debug"),
    "foundation-qwen3": ("  - foundation: qwen2_debug", "  - foundation: qwen3_debug"),
    "encoder-siglip": ("  - encoder: qwen2_5_vit_debug\n  - projector: patch_merge_mlp",
                       "  - encoder: siglip_vit_debug\n  - projector: mlp_2x"),
}


@pytest.mark.slow
@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_changing_one_line_swaps_the_part_and_trains(swap, tmp_path, vlm_cache):
    from loongforge.vlm.cli import main

    old, new = SWAPS[swap]
    text = (CONFIG_DIR / "vlm_debug.yaml").read_text()
    assert old in text
    config = tmp_path / "vlm.yaml"
    config.write_text(text.replace(old, new))
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), *FAST, "train.steps=3", f"data.cache_dir={vlm_cache}",
                 f"log.run_dir={run}"]) == 0
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    parts = manifest(run)["model_config"]
    expected = {"foundation-llama": ("llama", "qwen2_5_vit"), "foundation-qwen3": ("qwen3", "qwen2_5_vit"),
                "encoder-siglip": ("qwen2", "siglip_vit")}[swap]
    assert (parts["foundation"]["family"], parts["encoder"]["kind"]) == expected


def test_bad_config_is_one_clear_error(capsys):
    from loongforge.vlm.cli import main

    assert main(["train", "parallel.foundation.tp=2", "parallel.encoder.tp=4"]) == 2
    assert "parallel.encoder.tp=4: must be 1 or parallel.foundation.tp=2" in capsys.readouterr().err
    assert main(["train", "trainable=[projector,decoder]"]) == 2
    assert "trainable=['projector', 'decoder']" in capsys.readouterr().err
