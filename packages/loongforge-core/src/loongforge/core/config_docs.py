"""Every key of a config schema with its type, default and description, read from the dataclasses.

The description of a field is its comment in the dataclass source: the comment at the end of its
line, else the comment lines right above it. ``train --help``, the config reference of the docs
(``docs/gen_config_reference.py``, which lists a group's keys with ``describe_fields``) and the
tests that check both list every key come from here. A schema's ``UNSETTABLE`` class attribute
(``{dotted key: why}``) names keys its groups hold but the CLI refuses: they are not listed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import cache


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted, e.g. "train.lr"
    type: str
    default: str  # as shown by ``train --help``: repr of the value, "null", or "(required)"
    help: str
    value: object = field(default=MISSING, compare=False, repr=False)  # the default itself; MISSING when required


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
        line = lines[(node.end_lineno or node.lineno) - 1]
        text = _trailing_comment(line)
        if not text:  # the comment block right above the field
            above: list[str] = []
            i = node.lineno - 2
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


def schema_comments(schema: type) -> dict[str, str]:
    """``{field: comment}`` of a dataclass and its dataclass bases; a subclass's comment wins over
    its base's."""
    comments: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if is_dataclass(cls):
            comments.update({k: v for k, v in field_comments(cls).items() if v})
    return comments


def _nested(tp, default) -> typing.Any:
    """The dataclass a field is a group of, or None for a leaf: its annotation when that is a
    dataclass (a family's subclass as default is described as the annotated base), else its
    default's class."""
    if is_dataclass(tp):
        return tp
    if is_dataclass(default) and not isinstance(default, type):
        return type(default)
    return None


def describe_fields(schema: type, instance: object = None, prefix: str = "",
                    skip: typing.Collection[str] = ()) -> list[KeyDoc]:
    """The leaf keys ``schema`` itself holds, in declaration order, without its nested groups or
    the fields named in ``skip`` (e.g. a base class's, to list only what a subclass adds). The
    defaults are ``instance``'s values when given (a parent config may set its own), else the
    dataclass defaults."""
    out: list[KeyDoc] = []
    hints = typing.get_type_hints(schema)
    comments = schema_comments(schema)
    for f in fields(schema):
        if f.name in skip:
            continue
        tp = hints.get(f.name, f.type)
        default = getattr(instance, f.name) if instance is not None else _default(f)
        if _nested(tp, default) is not None:
            continue
        shown = "(required)" if default is MISSING else ("null" if default is None else repr(default))
        out.append(KeyDoc(f"{prefix}{f.name}", _type_name(tp), shown, comments.get(f.name, ""), default))
    return out


def describe_schema(schema: type, prefix: str = "", instance: object = None) -> list[KeyDoc]:
    """Every leaf key of ``schema`` (nested dataclasses are groups), in declaration order, with the
    defaults of ``instance`` (default: ``schema()`` where it has no required field, so a group's
    defaults are the ones its parent sets, e.g. a CLI's own ``train.lr``)."""
    if instance is None:
        try:
            instance = schema()
        except TypeError:  # a required field: the dataclass defaults, field by field
            instance = None
    leaves = {d.key: d for d in describe_fields(schema, instance, prefix)}
    hints = typing.get_type_hints(schema)
    out: list[KeyDoc] = []
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        if key in leaves:
            out.append(leaves[key])
            continue
        default = getattr(instance, f.name) if instance is not None else _default(f)
        nested = _nested(hints.get(f.name, f.type), default)
        out.extend(describe_schema(nested, f"{key}.", default if is_dataclass(default) else None))
    return [d for d in out if d.key[len(prefix):] not in unsettable(schema)]


def unsettable(schema: type) -> typing.Mapping[str, str]:
    """``{dotted key: why}``: the keys under ``schema`` that its CLI refuses (not documented)."""
    return getattr(schema, "UNSETTABLE", {})


def format_keys(docs: list[KeyDoc], changed: typing.Mapping[str, str] | None = None) -> str:
    """The keys grouped by their first part, one line each: ``key (type) = value  -- description``;
    a key in ``changed`` (key -> the value before the overrides) is marked ``[override; was V]``."""
    lines: list[str] = []
    group = None
    for doc in docs:
        head = doc.key.split(".", 1)[0] if "." in doc.key else ""
        if head != group:
            group = head
            lines.append(f"\n{head or 'top level'}:")
        mark = f"  [override; was {changed[doc.key]}]" if changed and doc.key in changed else ""
        lines.append(f"  {doc.key} ({doc.type}) = {doc.default}{mark}" + (f"  -- {doc.help}" if doc.help else ""))
    return "\n".join(lines).lstrip("\n")
