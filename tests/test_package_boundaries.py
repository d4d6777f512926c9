"""What the packages' shipped code (``packages/*/src``) may import of each other.

- The modality packages (llm, vlm, diffusion, embodied) import no other modality package, except
  vlm -> llm, which must go through llm's public API (``loongforge.llm.api``; checked file by
  file in ``packages/loongforge-vlm/tests/test_llm_api_use.py``).
- Nothing imports ``loongforge.kernels`` or ``loongforge.xpu``: the core finds them through their
  entry points (``loongforge.kernels``, ``loongforge.accelerators``).
- The core imports none of the other packages; kernels and xpu import only the core.

Tests and benchmarks may reach further (a kernel test calls the Triton kernels themselves).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"
MODALITIES = ("llm", "vlm", "diffusion", "embodied")
PLUGINS = ("kernels", "xpu")  # found through entry points only
ALLOWED = {("vlm", "llm")}  # (importer, imported): vlm's foundation is an llm family

# Known exceptions, each to be removed when fixed.
KNOWN: set[tuple[str, str]] = set()


def loongforge_imports(file: Path) -> list[tuple[int, str]]:
    """``(line, package)`` of every ``loongforge.<package>`` that ``file`` imports (statements and
    ``importlib.import_module`` calls with a constant name)."""
    found = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if node.module == "loongforge" else node.module for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        found += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("loongforge.")]
    return found


def forbidden(importer: str, imported: str) -> bool:
    if imported == importer or imported == "core":
        return False
    if importer in ("core", *PLUGINS) or imported in PLUGINS:
        return True
    return importer in MODALITIES and imported in MODALITIES and (importer, imported) not in ALLOWED


def test_packages_import_only_what_their_layer_allows():
    bad, seen = [], set()
    sources = sorted(PACKAGES.glob("loongforge-*/src/loongforge/*/**/*.py"))
    assert len({f.relative_to(PACKAGES).parts[0] for f in sources}) == 7, "expected the seven packages' sources"
    for file in sources:
        importer = file.relative_to(PACKAGES).parts[0].removeprefix("loongforge-")
        rel = file.relative_to(PACKAGES.parent).as_posix()
        for line, imported in loongforge_imports(file):
            if not forbidden(importer, imported):
                continue
            if (rel, f"loongforge.{imported}") in KNOWN:
                seen.add((rel, f"loongforge.{imported}"))
            else:
                bad.append(f"{rel}:{line}: loongforge-{importer} imports loongforge.{imported}")
    assert not bad, "imports across package boundaries:\n" + "\n".join(bad)
    assert seen == KNOWN, f"fixed, remove from KNOWN: {sorted(KNOWN - seen)}"
