"""The documentation: the generated config reference is current, the site's navigation covers
every page, and the links of the READMEs and pages lead to files that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REPO_BLOB = "https://github.com/loongforge/loongforge/blob/main/"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", DOCS / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_what_the_dataclasses_give():
    gen = _generator()
    text = gen.render()
    assert (DOCS / "config-reference.md").read_text() == text, \
        "docs/config-reference.md is out of date: run python docs/gen_config_reference.py"
    # every key of every CLI's config is listed, with its group prefix
    for cli, module, name, _ in gen.MODALITIES:
        config = getattr(importlib.import_module(module), name)()
        keys = []

        def walk(obj, prefix):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if dataclasses.is_dataclass(value):
                    walk(value, f"{prefix}{f.name}.")
                else:
                    keys.append(f"{prefix}{f.name}")

        walk(config, "")
        keys = [k for k in keys if k not in getattr(type(config), "UNSETTABLE", {})]  # refused: not documented
        section = text.split(f"## {cli}\n", 1)[1].split("\n## ", 1)[0]
        missing = [k for k in keys if f"| `{k}` |" not in section]
        assert not missing, f"{cli}: keys missing from the reference: {missing}"


def test_every_documented_key_has_a_description():
    """Every key of the four CLIs (the families' own keys included) has a help text."""
    undocumented, cli = [], None
    for line in _generator().render().splitlines():
        cli = line[3:] if line.startswith("## ") else cli
        cells = [c.strip() for c in line.strip("|").split(" | ")] if line.startswith("| `") else []
        if cells and not cells[-1]:
            undocumented.append(f"{cli} {cells[0]}")
    assert undocumented == []


def test_config_reference_carries_the_source_comments():
    text = (DOCS / "config-reference.md").read_text()
    # a comment next to a field in schema.py, and one above a field in diffusion's DataConfig
    assert "| `train.clip_grad` | float | `1.0` | max global grad norm; 0: no clipping" in text
    assert "a `lf-diffusion preprocess` output directory; null: the built-in moving-shapes set" in text


def _nav_files(nav) -> list[str]:
    found = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        found += _nav_files(value) if isinstance(value, list) else [value]
    return found


def test_site_navigation_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages


def _links(path: Path) -> list[str]:
    return LINK.findall(path.read_text())


def test_links_lead_to_files_that_exist():
    broken = []
    readmes = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
    for path in [*readmes, *sorted(DOCS.rglob("*.md"))]:
        for link in _links(path):
            target = link.split("#", 1)[0]
            if link.startswith(REPO_BLOB):
                resolved = ROOT / target[len(REPO_BLOB):]
            elif link.startswith(("http://", "https://", "#", "mailto:")):
                continue
            else:
                resolved = (path.parent / target).resolve()
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: {link}")
    assert not broken, broken


def test_package_readmes_link_the_docs_by_absolute_url():
    for readme in sorted(ROOT.glob("packages/*/README.md")):
        links = _links(readme)
        assert any(link.startswith(REPO_BLOB + "docs/") for link in links), readme
        assert all(link.startswith(("https://", "http://", "#")) for link in links), (readme, links)
