"""Stop-and-resume replays the uninterrupted run exactly (same losses bit for bit)."""

from __future__ import annotations

import json

import pytest

from embodied_helpers import tiny_overrides
from loongforge.core.checkpoint import latest_checkpoint
from loongforge.core.config import ConfigError
from loongforge.embodied.config import load_train_config
from loongforge.embodied.trainer import train


def run(dataset, run_dir, *extra):
    return train(load_train_config("train", tiny_overrides(dataset, run_dir, "tensorboard=false", "policy=groot", *extra)))


def test_resume_is_exact(tiny_dataset, tmp_path):
    straight = run(tiny_dataset, tmp_path / "a", "steps=6", "save_every=3")
    first = run(tiny_dataset, tmp_path / "b", "steps=3", "save_every=3")  # the process ends here ("killed")
    resumed = run(tiny_dataset, tmp_path / "b", "steps=6", "save_every=3")
    assert resumed.start_step == 3 and len(resumed.losses) == 3
    assert first.losses + resumed.losses == straight.losses  # exact equality
    assert len(set(straight.losses)) == 6
    ckpt = latest_checkpoint(tmp_path / "b" / "checkpoints")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["family"] == "groot" and manifest["consumed_samples"] == 24
    assert any(k.startswith("optim/") for k in manifest["tensors"])
    # nothing left to do: a third call resumes at the end and trains no step
    assert run(tiny_dataset, tmp_path / "b", "steps=6").losses == []


def test_resume_refuses_a_different_policy(tiny_dataset, tmp_path):
    run(tiny_dataset, tmp_path / "c", "steps=1")
    with pytest.raises(ValueError, match="policy.chunk_size"):
        run(tiny_dataset, tmp_path / "c", "steps=2", "policy.chunk_size=3")


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="policy.dit.widht"):
        load_train_config("train", ["policy=groot", "policy.dit.widht=3"])
    with pytest.raises(ConfigError, match="parallel.mode='zero3'"):
        load_train_config("train", ["parallel.mode=zero3"])
