"""Configuration: YAML composed with Hydra, validated into dataclasses.

``load_config(Schema, "name_or_path", ["a.b=1", "group=option"])``:

1. The YAML is found as a file path, or by name in ``config_dirs`` (configs ship as package data).
   Hydra composes its ``defaults`` list; overrides whose key names a config group
   (``foundation=llama``) select group options.
2. The composed YAML is merged into the dataclass schema: a key the schema does not know is an
   error naming the key and the file it came from.
3. Every other ``key=value`` override is applied on top (a key the schema does not know is an
   error naming the override), then the dataclass is built, which runs each ``__post_init__``.

``renamed`` maps a key's old dotted name (or a group's: ``policy``) to its new one: YAML and
overrides that still use the old name are read under the new one, with a one-line ``note:`` on
stderr, for one release. A key of ``DEPRECATED_KEYS`` (kept in the schema, with another meaning
next to it) is read as it is, with its note.

``fixed`` maps top-level sections whose value is the one ``schema`` (an instance) already holds to
the reason why: what the YAML composes for them is dropped, and an override of one of their keys
is an error giving that reason. A recipe uses it for a section it derives from elsewhere (an LLM's
``model`` read from a Hugging Face ``config.json``).

All of this happens before any process group is made, so a bad config costs no cluster time.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Any, TypeVar, cast, overload

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from loongforge.core.errors import UserError

T = TypeVar("T")

__all__ = ["ConfigError", "find_config", "load_config", "load_saved_config", "rename_overrides", "read_section", "to_dict", "to_yaml", "field_names",
           "leaf_keys", "did_you_mean", "yaml_error_message"]


class ConfigError(UserError, ValueError):
    """A configuration that cannot be used; the message names the key and where it came from."""


# keys still read for one release, with what replaces them (the schema keeps them: their meaning
# differs from the replacement's, so they are not a plain rename)
DEPRECATED_KEYS = {
    "train.min_lr": "train.min_lr_ratio (the last step's learning rate as a fraction of train.lr)",
}


def deprecation_note(old: str, new: str, source: str) -> None:
    """``note: OLD (SOURCE) is deprecated: use NEW`` on stderr, from the job's first rank only."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(f"note: {old} ({source}) is deprecated and read until the next release: use {new}", file=sys.stderr)


def _renamed_key(key: str, renamed: Mapping[str, str]) -> str | None:
    """``key`` under its new name when it, or a group holding it, was renamed (the longest old name
    that matches wins); None when it was not."""
    for old in sorted(renamed, key=len, reverse=True):
        if key == old or key.startswith(old + "."):
            return renamed[old] + key[len(old):]
    return None


def rename_overrides(overrides: Sequence[str], renamed: Mapping[str, str], note: bool = True) -> list[str]:
    """``key=value`` overrides with renamed keys under their new names (a note for each, unless not ``note``)."""
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        bare = key.strip()
        prefix = bare[:len(bare) - len(bare.lstrip("+~"))]
        new = _renamed_key(bare.lstrip("+~"), renamed) if sep else None
        if new is None:
            out.append(item)
            continue
        if note:
            deprecation_note(bare.lstrip("+~"), new, "the command line")
        out.append(f"{prefix}{new}={value}")
    return out


def _rename_composed(cfg: DictConfig, renamed: Mapping[str, str], path: Path, note: bool = True) -> None:
    """Move the composed YAML's values from renamed keys to their new names (refusing both set)."""
    absent = object()
    for old in sorted(renamed, key=len, reverse=True):
        value = OmegaConf.select(cfg, old, default=absent, throw_on_missing=False)
        if value is absent:
            continue
        parent_key, _, leaf = old.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        new = renamed[old]
        existing = OmegaConf.select(cfg, new, default=None, throw_on_missing=False)
        if existing is not None and not (isinstance(existing, DictConfig) and isinstance(value, DictConfig)):
            raise ConfigError(f"{path}: both {old} and {new} are set; {old} is the old name of {new}: keep one")
        parent.pop(leaf)
        if value is None and existing is not None:
            continue
        OmegaConf.update(cfg, new, value, merge=True, force_add=True)
        if note:
            deprecation_note(old, new, str(path))


def _note_deprecated(cfg: DictConfig | None, overrides: Sequence[str], source: str) -> None:
    for key, new in DEPRECATED_KEYS.items():
        if cfg is not None and OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is not None:
            deprecation_note(key, new, source)
        elif any(o.partition("=")[0].strip().lstrip("+~") == key for o in overrides):
            deprecation_note(key, new, "the command line")


def did_you_mean(value: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'X'?)`` for the choice closest to ``value``, or ``""`` when none is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _yaml_names(directory: Path) -> list[str]:
    return sorted(p.stem for p in Path(directory).glob("*.y*ml"))


def find_config(name_or_path: str, config_dirs: Sequence[Path]) -> Path:
    """Resolve a config given as a path or as a name (with or without .yaml) in ``config_dirs``."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_file():
        return candidate.resolve()
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        raise ConfigError(f"config file not found: {name_or_path}")
    for d in config_dirs:
        for suffix in (".yaml", ".yml"):
            path = Path(d) / f"{name_or_path}{suffix}"
            if path.is_file():
                return path.resolve()
    available = sorted({name for d in config_dirs for name in _yaml_names(d)})
    raise ConfigError(f"no config named {name_or_path!r}{did_you_mean(name_or_path, available)}; "
                      f"available: {', '.join(available) or 'none'}")


def config_label(path: Path, config_dirs: Sequence[Path]) -> str:
    """A config as a user named it: a shipped config by its name, any other by its path."""
    if any(path.parent == Path(d).resolve() for d in config_dirs):
        return f"config {path.stem}"
    return str(path)


def _check_group_options(group_overrides: list[str], path: Path, config_dirs: Sequence[Path]) -> None:
    """``group=option`` names an option of the group: a YAML in ``GROUP/`` of a config directory."""
    for item in group_overrides:
        key, _, option = item.partition("=")
        group = key.strip().lstrip("+~")
        if key.strip().startswith("~") or option.strip() in ("", "null"):
            continue
        dirs = [path.parent, *map(Path, config_dirs)]
        if any((d / group / f"{option.strip()}{suffix}").is_file() for d in dirs for suffix in (".yaml", ".yml")):
            continue
        choices = sorted({name for d in dirs for name in _yaml_names(d / group)})
        raise ConfigError(f"{group}={option}: no such option of config group {group!r}"
                          f"{did_you_mean(option.strip(), choices)}; choices: {', '.join(choices) or 'none'}")


def _compose(path: Path, group_overrides: list[str], config_dirs: Sequence[Path]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    _check_group_options(group_overrides, path, config_dirs)
    search = [d for d in {Path(d).resolve() for d in config_dirs} if d != path.parent]
    overrides = list(group_overrides)
    if search:
        overrides.append("hydra.searchpath=[" + ",".join(f"file://{d}" for d in sorted(search)) + "]")
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base=None):
            cfg = compose(config_name=path.stem, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path}: cannot compose config: {first}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_message(exc, path)) from exc
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    assert isinstance(plain, DictConfig)  # a composed config is a mapping
    plain.pop("hydra", None)
    return plain


def yaml_error_message(exc: yaml.YAMLError, path: Path) -> str:
    """``FILE:LINE:COL: not valid YAML: PROBLEM`` (the file the parser was reading, else ``path``)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{mark.name if mark and mark.name and not mark.name.startswith('<') else path}"
    if mark is not None:
        where += f":{mark.line + 1}:{mark.column + 1}"
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}: not valid YAML: {problem}"


def _is_group(key: str, path: Path, config_dirs: Sequence[Path]) -> bool:
    dirs = [path.parent, *map(Path, config_dirs)]
    return "." not in key.lstrip("+~") and any((d / key.lstrip("+~")).is_dir() for d in dirs)


def leaf_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a (structured) config; a group's own keys, not a list's items."""
    out: list[str] = []
    container = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    assert isinstance(container, dict)  # a DictConfig's container
    for key, value in container.items():
        out += _leaves(value, f"{prefix}{key!s}")
    return out


def _leaves(value, key: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [k for sub, v in value.items() for k in _leaves(v, f"{key}.{sub}")]
    return [key]


def _closest_key(key: str, keys: Sequence[str]) -> str:
    """``did_you_mean`` for a dotted key: a near name in the same group (``train.stpes``), else a near
    whole key (``trian.steps``)."""
    group, _, name = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == group}
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {siblings[close[0]]!r}?)"
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.85)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key_message(exc: OmegaConfBaseException, cfg: DictConfig | None = None) -> str:
    """``unknown key 'a.b' (did you mean 'a.c'?)`` for a key the schema does not have, else the
    first line of omegaconf's message naming the key (never its internal class names)."""
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    msg = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    if key and cfg is not None and isinstance(exc, ConfigKeyError):
        return f"unknown key {key!r}{_closest_key(str(key), leaf_keys(cfg))}"
    return f"key {key!r}: {msg}" if key else msg


@overload
def load_config(schema: type[T], name_or_path: str | None, overrides: Sequence[str] = (),
                config_dirs: Sequence[Path] = (), fixed: Mapping[str, str] | None = None,
                renamed: Mapping[str, str] | None = None, notes: bool = True) -> T: ...
@overload
def load_config(schema: T, name_or_path: str | None, overrides: Sequence[str] = (),
                config_dirs: Sequence[Path] = (), fixed: Mapping[str, str] | None = None,
                renamed: Mapping[str, str] | None = None, notes: bool = True) -> T: ...
def load_config(
    schema: type[T] | T,
    name_or_path: str | None,
    overrides: Sequence[str] = (),
    config_dirs: Sequence[Path] = (),
    fixed: Mapping[str, str] | None = None,
    renamed: Mapping[str, str] | None = None,
    notes: bool = True,
) -> T:
    """Compose, merge into ``schema`` (a dataclass, or an instance of one whose defaults it keeps:
    a section holding a subclass of the declared config), apply overrides, validate. See module doc.
    ``notes``: print the deprecation notes (off for a second load of the same command line)."""
    if not is_dataclass(schema):
        raise TypeError(f"config schema must be a dataclass, got {schema!r}")
    overrides = rename_overrides(overrides, renamed or {}, note=notes)
    if notes:
        _note_deprecated(None, overrides, "the command line")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        section = item.split("=", 1)[0].lstrip("+~").split(".", 1)[0]
        if fixed and section in fixed:
            raise ConfigError(f"override {item!r}: {fixed[section]}")
    structured = OmegaConf.structured(schema)
    source = "defaults"
    value_overrides = list(overrides)
    if name_or_path is not None:
        path = find_config(name_or_path, config_dirs)
        source = config_label(path, config_dirs)
        groups = [o for o in overrides if _is_group(o.split("=", 1)[0], path, config_dirs)]
        value_overrides = [o for o in overrides if o not in groups]
        composed = _compose(path, groups, config_dirs)
        if renamed:
            _rename_composed(composed, renamed, path, note=notes)
        if notes:
            _note_deprecated(composed, (), str(path))
        for section in fixed or ():
            composed.pop(section, None)
        try:
            structured = OmegaConf.merge(structured, composed)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{path}: {_unknown_key_message(exc, structured)}") from exc
    for item in value_overrides:
        try:
            structured = OmegaConf.merge(structured, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            if isinstance(exc, ConfigKeyError):  # named as the user wrote it (foo.bar, not only foo)
                key = item.split("=", 1)[0].strip().lstrip("+~")
                raise ConfigError(f"unknown key {key!r}{_closest_key(key, leaf_keys(structured))}") from exc
            raise ConfigError(f"override {item!r} ({source}): {_unknown_key_message(exc)}") from exc
    try:
        return cast(T, OmegaConf.to_object(structured))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{source}: {_unknown_key_message(exc)}") from exc
    except (ValueError, TypeError) as exc:  # raised by a schema's __post_init__
        raise ConfigError(f"{source}: {exc}") from exc


def load_saved_config(saved: Mapping, load: Callable[[str, list[str]], T], overrides: Sequence[str] = (),
                      source: str = "the checkpoint's config") -> T:
    """A run config saved as a plain dict (a checkpoint manifest's ``config``), with ``key=value``
    overrides, read back through the CLI's own ``load(config path, overrides)`` from a YAML file of
    it: the renamed keys, family dispatch and checks are the ones a fresh run gets. An error names
    ``source`` rather than the temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "saved_config.yaml"
        path.write_text(json.dumps(dict(saved)))  # JSON is YAML
        try:
            return load(str(path), list(overrides))
        except ConfigError as exc:
            raise ConfigError(str(exc).replace(str(path), source)) from exc


def read_section(schema: type, section: str, name_or_path: str | None, overrides: Sequence[str] = (),
                 config_dirs: Sequence[Path] = (), renamed: Mapping[str, str] | None = None) -> dict:
    """The composed config's ``section``, read with every section of ``schema`` untyped: how a
    recipe learns which family's config class validates that section (``model.family``,
    ``model.family``) before the typed load. Overrides of keys outside the schema's sections are
    left to that load too (a misspelt ``foo.bar=1`` must not hide which family ``section`` names).
    Empty when the config does not compose (the typed load then reports the error against the real
    schema)."""
    names = field_names(schema)
    sections = make_dataclass(f"{schema.__name__}Sections", [(name, Any, None) for name in names])
    overrides = rename_overrides(overrides, renamed or {}, note=False)
    known = [o for o in overrides if "=" not in o or o.split("=", 1)[0].strip().lstrip("+~").split(".", 1)[0] in names]
    try:
        value = getattr(load_config(sections, name_or_path, known, config_dirs, renamed=renamed, notes=False), section)
    except ConfigError:
        return {}
    return value if isinstance(value, dict) else {}


def to_dict(cfg: Any) -> dict:
    """A plain, JSON-serialisable dict of a config dataclass."""
    return cast(dict, OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def field_names(schema: type) -> list[str]:
    return [f.name for f in fields(schema)]
