import argparse
import json

import pytest

from loongforge.core.cli import add_run_commands, normalise_overrides, run_main
from loongforge.core.config import ConfigError


def test_override_spellings_normalise_to_key_value():
    assert normalise_overrides(["--policy", "groot", "--dataset.root", "/d", "steps=3", "--seed=4"]) == [
        "policy=groot", "dataset.root=/d", "steps=3", "seed=4"]


@pytest.mark.parametrize(("items", "message"), [(["--train.steps"], "--train.steps needs a value"),
                                                (["train.steps"], "'train.steps'")])
def test_malformed_overrides_are_config_errors(items, message, capsys):
    with pytest.raises(ConfigError, match=message):
        normalise_overrides(items)
    assert run_main(lambda: normalise_overrides(items)) == 2
    assert message.strip("'") in capsys.readouterr().err


def test_plot_command_draws_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 / s, "tokens_per_s": 100.0 + s}) + "\n" for s in range(1, 6)))
    parser = argparse.ArgumentParser()
    add_run_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plot", str(run)])
    assert args.fn(args) == 0
    written = capsys.readouterr().out.split("wrote ", 1)[1].strip()
    assert written.endswith(".png") and (tmp_path / "run" / written.rsplit("/", 1)[-1]).stat().st_size > 1000
