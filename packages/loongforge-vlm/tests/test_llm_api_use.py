"""loongforge-vlm uses loongforge-llm through its public API only (``loongforge.llm.api``, whose
names ``loongforge.llm`` re-exports): any other ``loongforge.llm.*`` module is private to llm."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
PUBLIC = ("loongforge.llm", "loongforge.llm.api")



def private_llm_imports(source: str, filename: str, public_names) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a private ``loongforge.llm`` module in ``source``:
    ``import``/``from`` statements and ``importlib.import_module("...")`` calls."""

    def private(module: str) -> bool:
        return (module == "loongforge.llm" or module.startswith("loongforge.llm.")) and module not in PUBLIC

    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "loongforge.llm":  # ``from loongforge.llm import recipe``: a submodule
                found += [(node.lineno, f"loongforge.llm.{a.name}") for a in node.names
                          if a.name not in public_names and f"loongforge.llm.{a.name}" not in PUBLIC]
            elif private(node.module):
                found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and private(node.args[0].value)):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def vlm_files() -> list[Path]:
    files = sorted([*(PACKAGE / "src").rglob("*.py"), *(PACKAGE / "tests").rglob("*.py")])
    assert any(f.name == "model.py" for f in files) and any(f.name == "test_vlm_data.py" for f in files)
    return files


def test_the_check_finds_each_kind_of_private_import():
    source = ("import loongforge.llm.recipe\n"
              "from loongforge.llm.data.errors import DataError\n"
              "from loongforge.llm import recipe, GPTConfig\n"
              "def f():\n"
              "    import importlib\n"
              "    return importlib.import_module('loongforge.llm.families.gpt')\n"
              "import loongforge.llm.api\n"
              "from loongforge.llm.api import DataError\n"
              "from loongforge.llm import DataError, api\n"
              "from loongforge.llmx import y\n")
    assert [line for line, _ in private_llm_imports(source, "<test>", {"GPTConfig", "DataError"})] == [1, 2, 3, 6]


def test_vlm_imports_only_the_public_api_of_llm():
    from loongforge.llm import api

    bad = []
    for file in vlm_files():
        rel = file.relative_to(PACKAGE).as_posix()
        hits = private_llm_imports(file.read_text(encoding="utf-8"), rel, set(api.__all__))
        bad += [f"packages/loongforge-vlm/{rel}:{line}: imports {module}" for line, module in hits]
    assert not bad, ("loongforge-vlm must use loongforge-llm's public API (loongforge.llm.api); add what it needs "
                     "there instead of importing llm's private modules:\n" + "\n".join(bad))
