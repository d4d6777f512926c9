"""Every user-settable key of each CLI's default config counts: set to another value on the command
line, the resolved config (what ``config.yaml`` and ``--print-config`` show) holds that value, or
the override is refused with a ``UserError`` (one ``error:`` line); and a value of the wrong type
for a number or a flag is refused naming the key. A config-level check: nothing trains. Marked ``long``
(a config load per key, minutes in all): ``uv run pytest tests/test_every_key_counts.py -m long``."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from loongforge.core.config import leaf_keys, to_dict
from loongforge.core.errors import UserError
from loongforge.diffusion.cli import describe_cli as diffusion_cli
from loongforge.embodied.cli import describe_cli as embodied_cli
from loongforge.llm.cli import describe_cli as llm_cli
from loongforge.vlm.cli import describe_cli as vlm_cli

CLIS = {"lf-llm": llm_cli, "lf-vlm": vlm_cli, "lf-diffusion": diffusion_cli, "lf-embodied": embodied_cli}


def value_at(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config


def another(value) -> tuple[str, object] | None:
    """An override value other than ``value`` and what the resolved config then holds; None for a
    list or mapping (set as a whole through their own keys' tests)."""
    if isinstance(value, bool):
        return str(not value).lower(), not value
    if isinstance(value, int):
        return str(value + 1), value + 1
    if isinstance(value, float):
        new = value * 2 if value else 0.5
        return repr(new), new
    if value is None:
        return "1", None  # Optional[int] or Optional[str]: either 1 or "1"
    if isinstance(value, str):
        return f"{value}x" if value else "x", f"{value}x" if value else "x"
    return None


def resolved(app, overrides: list[str]) -> dict:
    return to_dict(app.load_config(app.default_config, overrides))


@pytest.fixture(scope="module", params=list(CLIS))
def cli(request):
    app = CLIS[request.param]()
    base = resolved(app, [])
    return app, base, leaf_keys(OmegaConf.create(base))


@pytest.mark.long  # one config load per key: about a minute per CLI on a loaded 2-core machine
def test_every_key_changes_the_config_or_is_refused(cli):
    app, base, keys = cli
    ignored = []
    for key in keys:
        change = another(value_at(base, key))
        if change is None:
            continue
        text, want = change
        try:
            got = value_at(resolved(app, [f"{key}={text}"]), key)
        except UserError:
            continue  # refused, with a message: fine
        if got != want and not (want is None and got in (1, "1")):  # 1, "1" or True (== 1)
            ignored.append(f"{key}={text} -> {got!r}")
    assert not ignored, f"{app.prog}: overrides accepted but not in the resolved config: {ignored}"


@pytest.mark.long  # one config load per number or flag key
def test_a_wrong_type_is_refused_naming_the_key(cli):
    app, base, keys = cli
    unnamed = []
    for key in keys:
        value = value_at(base, key)
        if not isinstance(value, bool | int | float):
            continue
        try:
            resolved(app, [f"{key}=not_a_number"])
        except UserError as exc:
            if key.rsplit(".", 1)[-1] not in str(exc):
                unnamed.append(f"{key}: {str(exc).splitlines()[0]}")
            continue
        unnamed.append(f"{key}=not_a_number accepted")
    assert not unnamed, f"{app.prog}: {unnamed}"
