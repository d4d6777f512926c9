"""Every key of a config schema with its type, default and description, read from the dataclasses.

The description of a field is its comment in the dataclass source: the comment at the end of its
line, else the comment lines right above it. ``train --help``, the config reference of the docs
and the tests that check both list every key come from here.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import cache


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, e.g. "train.lr"
    type: str
    default: str
    help: str


@cache
def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` of one dataclass, from its source (empty when the source is not available)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[str, str] = {}
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = lines[node.end_lineno - 1]
        text = _trailing_comment(line)
        if not text:  # the comment block right above the field
            above, i = [], node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            text = " ".join(above)
        comments[node.target.id] = text
    return comments


def _trailing_comment(line: str) -> str:
    """The ``# ...`` at the end of a source line, outside any string literal."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[i + 1:].strip()
    return ""


def _type_name(tp) -> str:
    if isinstance(tp, str):
        return tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"


def _default(f) -> object:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def describe_schema(schema: type, prefix: str = "") -> list[KeyDoc]:
    """Every leaf key of ``schema`` (nested dataclasses are groups), in declaration order."""
    out: list[KeyDoc] = []
    hints = typing.get_type_hints(schema)
    comments: dict[str, str] = {}
    for cls in reversed(schema.__mro__):  # a subclass's comment wins over its base's
        if is_dataclass(cls):
            comments.update({k: v for k, v in field_comments(cls).items() if v})
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        tp = hints.get(f.name, f.type)
        default = _default(f)
        if is_dataclass(tp) or is_dataclass(default):
            out.extend(describe_schema(tp if is_dataclass(tp) else type(default), f"{key}."))
            continue
        shown = "(required)" if default is MISSING else ("null" if default is None else repr(default))
        out.append(KeyDoc(key, _type_name(tp), shown, comments.get(f.name, "")))
    return out


def format_keys(docs: list[KeyDoc], width: int = 100) -> str:
    """The keys grouped by their first part, one line each: ``key  type = default  description``."""
    lines: list[str] = []
    group = None
    for doc in docs:
        head = doc.key.split(".", 1)[0] if "." in doc.key else ""
        if head != group:
            group = head
            lines.append(f"\n{head or 'top level'}:")
        lines.append(f"  {doc.key} ({doc.type}) = {doc.default}" + (f"  -- {doc.help}" if doc.help else ""))
    return "\n".join(lines).lstrip("\n")
