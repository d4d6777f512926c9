"""The wheels as pip users get them: every package is built with ``uv build --wheel`` and its
METADATA and contents checked (license, project URLs, classifiers, pinned siblings, the ``gpu``
extras, loongforge-core's optional ``megatron``/``plot``/``tensorboard``/``wandb`` extras and every modality's
``wandb`` extra, tested upper bounds
for torch and transformers, a README that reads on its own)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
MODALITIES = ("loongforge-llm", "loongforge-vlm", "loongforge-diffusion", "loongforge-embodied")
REPO_URL = "https://github.com/loongforge/loongforge"
BOUNDED = ("torch", "transformers")  # upper bounds at what uv.lock tests


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")  # `uv run` names itself in $UV
    if not uv:
        pytest.skip("uv not found")
    return uv


def _pyproject(name: str) -> dict:
    return tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]


def _locked_versions() -> dict[str, Version]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return {canonicalize_name(p["name"]): Version(p["version"]) for p in lock["package"] if "version" in p}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    uv = _uv()
    built = {}
    for name in PACKAGES:
        subprocess.run([uv, "build", "--wheel", "--package", name, "-o", str(out), "--quiet"],
                       cwd=ROOT, check=True, capture_output=True, text=True)
        version = _pyproject(name)["version"]
        wheel = out / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        assert wheel.is_file(), sorted(p.name for p in out.iterdir())
        built[name] = wheel
    return built


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        (path,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(path).decode())


def _requirements(meta) -> list[Requirement]:
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or []]


def _extra_of(req: Requirement) -> str | None:
    """The extra a requirement belongs to (``extra == 'gpu'`` in its marker), or None."""
    found = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", str(req.marker or ""))
    return found.group(1) if found else None


def test_all_packages_share_the_workspace_version():
    assert len(PACKAGES) == 7, PACKAGES
    versions = {name: _pyproject(name)["version"] for name in PACKAGES}
    assert len(set(versions.values())) == 1, versions


def test_license_files_in_the_packages_are_the_root_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "The LoongForge Authors" in text
    for name in PACKAGES:
        assert (ROOT / "packages" / name / "LICENSE").read_text() == text, name


@pytest.mark.parametrize("name", PACKAGES)
def test_wheel_license_urls_and_classifiers(wheels, name):
    meta = _metadata(wheels[name])
    assert meta["Name"] == name
    assert (meta.get("License-Expression") or meta.get("License")) == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    with zipfile.ZipFile(wheels[name]) as zf:
        licenses = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/licenses/LICENSE", n)]
        assert len(licenses) == 1, zf.namelist()
        assert zf.read(licenses[0]).decode() == (ROOT / "LICENSE").read_text()

    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(urls), urls
    assert all(u.startswith(REPO_URL) for u in urls.values()), urls

    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.12" in classifiers, classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers), classifiers
    assert any(c.startswith("Topic ::") for c in classifiers), classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # the expression says it


@pytest.mark.parametrize("name", PACKAGES)
def test_wheel_requirements(wheels, name):
    meta = _metadata(wheels[name])
    version = meta["Version"]
    requirements = _requirements(meta)
    siblings = [r for r in requirements if r.name.startswith("loongforge-")]
    if name != "loongforge-core":
        assert any(r.name == "loongforge-core" and _extra_of(r) is None for r in siblings), siblings
    for req in siblings:
        assert str(req.specifier) == f"=={version}", f"{name}: {req} is not pinned to {version}"

    locked = _locked_versions()
    for req in requirements:
        if canonicalize_name(req.name) in BOUNDED:
            uppers = [s for s in req.specifier if s.operator in ("<", "<=", "~=", "==")]
            assert uppers, f"{name}: {req} has no upper bound"
            tested = locked[canonicalize_name(req.name)]
            assert req.specifier.contains(tested), f"{name}: {req} excludes the tested {req.name} {tested}"

    base = {canonicalize_name(r.name) for r in requirements if _extra_of(r) is None}
    assert not base & {"matplotlib", "tensorboard", "wandb"}, f"{name}: plotting/TensorBoard/W&B outside an extra"
    if name == "loongforge-core":
        extras = {_extra_of(r): canonicalize_name(r.name) for r in requirements if _extra_of(r)}
        assert extras == {"megatron": "megatron-core", "plot": "matplotlib", "tensorboard": "tensorboard",
                          "wandb": "wandb"}, extras
        assert "megatron-core" not in base  # the core alone runs the PyTorch-native engine
    if name in MODALITIES:
        (core,) = [r for r in siblings if r.name == "loongforge-core" and _extra_of(r) is None]
        assert {"plot", "tensorboard"} <= core.extras, core  # a training install logs and plots
        assert "wandb" not in core.extras, core  # W&B is the user's choice: loongforge-core[wandb]
        # the megatron-core engine: what the LLM and VLM families train on, and only they
        assert ("megatron" in core.extras) == (name in ("loongforge-llm", "loongforge-vlm")), core
        assert "gpu" in (meta.get_all("Provides-Extra") or [])
        gpu = [r for r in requirements if _extra_of(r) == "gpu"]
        assert any(r.name == "loongforge-kernels" and str(r.specifier) == f"=={version}" for r in gpu), gpu
        # `pip install loongforge-X[wandb]` installs W&B (through loongforge-core's extra)
        (wandb,) = [r for r in requirements if _extra_of(r) == "wandb"]
        assert wandb.name == "loongforge-core" and wandb.extras == {"wandb"} and str(wandb.specifier) == f"=={version}"
    if name == "loongforge-diffusion":
        assert "accelerate" in base  # diffusers' from_pretrained of the exported WanTransformer3DModel


@pytest.mark.parametrize("name", PACKAGES)
def test_wheel_readme_stands_on_its_own(wheels, name):
    """The PyPI page: installs with pip, links only to absolute URLs, no workspace commands."""
    meta = _metadata(wheels[name])
    assert meta["Description-Content-Type"] == "text/markdown"
    readme = meta.get_payload()
    assert f"pip install {name}" in readme or f'pip install "{name}[' in readme, name
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [link for link in links if not link.startswith(("https://", "http://", "#"))]
    assert not relative, f"{name}: relative links {relative}"
    assert "uv run" not in readme and "root README" not in readme, name
