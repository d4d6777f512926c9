"""One vocabulary across the four ``lf-*`` CLIs: the groups ``--help`` calls shared are in every
CLI's schema with the same keys, a group two CLIs both have means the same keys in each, the model,
data location and tokenizer have one name each, and the names of earlier releases are still read
(with one ``note:`` line each) until the next release."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest

from loongforge.core.cli import SHARED_GROUPS
from loongforge.core.config import leaf_keys
from loongforge.core.training import schema as shared
from loongforge.diffusion.cli import describe_cli as diffusion_cli
from loongforge.embodied.cli import describe_cli as embodied_cli
from loongforge.llm.cli import describe_cli as llm_cli
from loongforge.vlm.cli import describe_cli as vlm_cli

APPS = {"lf-llm": llm_cli, "lf-vlm": vlm_cli, "lf-diffusion": diffusion_cli, "lf-embodied": embodied_cli}
# the class each group's keys come from in core (a CLI may extend it, never rename or drop a key)
CORE_GROUPS = {"train": shared.TrainConfig, "parallel": shared.ParallelConfig, "checkpoint": shared.CheckpointConfig,
               "log": shared.LogConfig, "lora": shared.LoRAConfig, "balance": shared.BalanceConfig,
               "eval": shared.EvalConfig}


@pytest.fixture(scope="module")
def configs() -> dict:
    """Each CLI's default config, resolved as ``lf-X train`` resolves it."""
    out = {}
    for cli, describe in APPS.items():
        app = describe()
        out[cli] = app.load_config(app.default_config, [])
    return out


def _keys(section) -> set[str]:
    from omegaconf import OmegaConf

    return set(leaf_keys(OmegaConf.structured(section)))


def test_the_groups_help_calls_shared_are_in_every_cli_with_the_core_keys(configs):
    for group in SHARED_GROUPS:
        core = _keys(CORE_GROUPS[group]())
        for cli, cfg in configs.items():
            section = getattr(cfg, group, None)
            assert section is not None, f"{cli} has no {group} group, which --help calls shared"
            assert isinstance(section, CORE_GROUPS[group]), (cli, group, type(section))
            assert core <= _keys(section), (cli, group, core - _keys(section))


def test_a_group_two_clis_have_has_the_same_keys_in_each(configs):
    """``balance`` and ``eval`` are not in every CLI; where they are, they are core's class, and the
    other top-level groups that several CLIs have (``model``, ``data``) are named for the same thing."""
    for group, base in CORE_GROUPS.items():
        holders = [cli for cli, cfg in configs.items() if hasattr(cfg, group)]
        for cli in holders:
            assert isinstance(getattr(configs[cli], group), base), (cli, group)
    assert {cli for cli, cfg in configs.items() if hasattr(cfg, "balance")} == {"lf-llm", "lf-vlm", "lf-diffusion"}
    assert {cli for cli, cfg in configs.items() if hasattr(cfg, "eval")} == {"lf-embodied"}


def test_the_model_data_and_tokenizer_have_one_name(configs):
    """The model is ``model`` (lf-vlm composes encoder, projector and foundation), the data location
    ``data.path`` (lf-llm blends several preprocessed datasets: ``data.prefixes``) and the tokenizer
    ``data.tokenizer`` wherever a CLI has them; no CLI keeps an old name."""
    for cli, cfg in configs.items():
        top = {f.name for f in fields(cfg)}
        assert "data" in top and not {"policy", "dataset"} & top, (cli, top)
        if cli != "lf-vlm":
            assert "model" in top and is_dataclass(cfg.model), cli
        data = {f.name for f in fields(cfg.data)}
        assert "root" not in data, cli
        if cli != "lf-llm":
            assert "path" in data, (cli, data)
        model = {f.name for f in fields(cfg.model)} if "model" in top else set()
        assert "tokenizer" not in model, cli
    for cli in ("lf-llm", "lf-vlm", "lf-embodied"):
        assert "tokenizer" in {f.name for f in fields(configs[cli].data)}, cli


def test_lr_alone_scales_the_schedule(configs):
    """``train.min_lr_ratio`` keeps each shipped config's last-step LR (lr / 10; lf-embodied lr / 30)
    and follows a new ``train.lr``."""
    for cli, describe in APPS.items():
        app = describe()
        cfg = configs[cli]
        assert cfg.train.min_lr is None
        expected = 1 / 30 if cli == "lf-embodied" else 0.1
        assert cfg.train.min_lr_ratio == pytest.approx(expected, rel=1e-9)
        lowered = app.load_config(app.default_config, ["train.lr=1e-4"])
        assert lowered.train.final_lr == pytest.approx(1e-4 * expected, rel=1e-9)


def test_old_names_are_read_with_one_note_each(capsys):
    """lf-embodied's ``policy`` group, ``data.root`` and ``policy.tokenizer``, lf-diffusion's
    ``data.root`` and the absolute ``train.min_lr``: the same config as the new names, one note each."""
    embodied, diffusion = embodied_cli(), diffusion_cli()
    capsys.readouterr()
    old = embodied.load_config("train", ["policy=pi0", "policy.chunk_size=4", "data.root=/d", "policy.tokenizer=/t",
                                         "train.min_lr=1e-4"])
    notes = capsys.readouterr().err.strip().splitlines()
    new = embodied.load_config("train", ["model=pi0", "model.chunk_size=4", "data.path=/d", "data.tokenizer=/t",
                                         "train.min_lr=1e-4"])
    assert old == new and new.model.family == "pi0" and new.data.path == "/d" and new.data.tokenizer == "/t"
    assert new.train.final_lr == 1e-4
    assert len(notes) == 5 and all(line.startswith("note: ") for line in notes), notes
    for old_key, new_key in (("policy", "model"), ("policy.chunk_size", "model.chunk_size"), ("data.root", "data.path"),
                             ("policy.tokenizer", "data.tokenizer"), ("train.min_lr", "train.min_lr_ratio")):
        assert any(f"note: {old_key} (" in line and f"use {new_key}" in line for line in notes), (old_key, notes)
    capsys.readouterr()
    assert diffusion.load_config("tiny", ["data.root=/latents"]).data.path == "/latents"
    assert "note: data.root (the command line)" in capsys.readouterr().err


def test_an_old_name_in_a_yaml_is_read_and_both_names_are_refused(tmp_path, capsys):
    from loongforge.core.config import ConfigError

    app = embodied_cli()
    old = tmp_path / "old.yaml"
    old.write_text("defaults:\n  - model: pi0\n  - _self_\npolicy:\n  chunk_size: 4\n  tokenizer: /t\ndata:\n  root: /d\n")
    cfg = app.load_config(str(old), [])
    assert cfg.model.family == "pi0" and cfg.model.chunk_size == 4 and cfg.data.path == "/d"
    assert cfg.data.tokenizer == "/t"
    err = capsys.readouterr().err
    assert f"note: data.root ({old})" in err and f"note: policy ({old})" in err
    both = tmp_path / "both.yaml"
    both.write_text("data:\n  root: /d\n  path: /e\n")
    with pytest.raises(ConfigError, match="both data.root and data.path are set"):
        app.load_config(str(both), [])
