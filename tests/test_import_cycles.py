"""No two modules of the shipped code (``packages/*/src``) import each other, directly or through
others: every ``import`` counts, a function-level (lazy) one too. The graph is read from the source
(``ast``), one node per module; a cycle is a strongly connected component of more than one module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"


def shipped_modules() -> dict[str, Path]:
    out = {}
    for file in PACKAGES.glob("*/src/loongforge/**/*.py"):
        parts = file.parts[file.parts.index("src") + 1:]
        name = ".".join(parts)[: -len(".py")]
        out[name.removesuffix(".__init__")] = file
    return out


def imported_modules(file: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The shipped modules ``file`` (module ``name``) imports: ``from pkg import mod`` names the module."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    out = set()
    for module in found:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module and module != name:
            out.add(module)
    return out


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    modules = shipped_modules()
    graph = {name: imported_modules(file, name, modules) for name, file in modules.items()}
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import cycles: {found}"
