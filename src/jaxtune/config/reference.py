"""The configuration reference, `docs/config.md`, rendered from the schema itself.

Every section of `Config` (in its field order) becomes a heading with the section class's docstring and a table of its
keys: the dotted key, a readable type, the default as YAML writes it, and the field's ``description``. A nested
section (``model.lora``) or a list of them (``objective.rewards``) gets a heading of its own, linked from its row. A
section that is a union of classes (``model``, keyed by ``backend``; ``objective``, by ``name``) lists the keys every
class shares, then each class's own keys. Nothing here names a key: a field added to a section appears in the
reference once it is regenerated.

    python -m jaxtune.config.reference                          # print the reference
    python -m jaxtune.config.reference --write docs/config.md   # rewrite the checked-in copy

Imports only pydantic, PyYAML and `jaxtune.config` (no JAX), so it runs in a second.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from jaxtune.config import Config

COMMAND = "python -m jaxtune.config.reference --write docs/config.md"
HEADER = (
    "# Configuration reference\n\n"
    f"_Generated from the config classes in `jaxtune.config` by `{COMMAND}`; do not edit it by hand: change the "
    "section's docstring or the field's `description` and run that command._\n"
)
INTRO = (
    "A run's config is YAML with one mapping per section; any key can be set on the command line as a dotted "
    "override (`jaxtune train CONFIG section.key=value ...`, values read as YAML). Configs are validated when "
    "loaded and frozen; an unknown key or a bad value is an error naming the key (and, for a misspelt key, the "
    "nearest valid one). A run's resolved config is written to `RUN_DIR/config.yaml` and into every checkpoint.\n\n"
    "Types: `null` is YAML's empty value; `one of: a, b` lists the accepted words; `>= 1` and the like are the "
    "bounds a value is checked against. A default of `required` means the key has none."
)

_NONE = type(None)


# --- types, defaults and text -------------------------------------------------------------------------------------


def _strip(tp: Any) -> Any:
    """``tp`` without ``Annotated[...]`` wrappers."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def sections_in(tp: Any) -> list[type[BaseModel]]:
    """The section classes a field holds directly: ``tp`` itself, or the members of a union (``X | None`` included)."""
    tp = _strip(tp)
    members = [_strip(a) for a in get_args(tp)] if _is_union(tp) else [tp]
    return [m for m in members if _is_section(m)]


def list_item_section(tp: Any) -> type[BaseModel] | None:
    """The section class of a ``list[Section]`` (or ``list[Section] | None``) field, else None."""
    tp = _strip(tp)
    members = [_strip(a) for a in get_args(tp) if a is not _NONE] if _is_union(tp) else [tp]
    if len(members) == 1 and get_origin(members[0]) in (list, tuple, typing.Sequence):
        args = [a for a in get_args(members[0]) if a is not Ellipsis]
        if len(args) == 1 and _is_section(_strip(args[0])):
            return _strip(args[0])
    return None


def _yaml(value: Any) -> str:
    """``value`` as a YAML flow value (``null``, ``true``, ``[q, k]``, ``0.0003``)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True, sort_keys=False)
    text = text.strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")].strip()
    return text


def type_text(tp: Any) -> str:
    """A readable type: ``int``, ``str | null``, ``one of: a, b``, ``list[str]``, ``dict[str, str]``."""
    tp = _strip(tp)
    origin, args = get_origin(tp), get_args(tp)
    if tp is _NONE:
        return "null"
    if tp is Any:
        return "any"
    if _is_union(tp):
        members = [a for a in args if a is not _NONE]
        text = " | ".join(type_text(a) for a in members)
        if _NONE in args:
            text = f"{text}, or null" if len(members) == 1 and get_origin(_strip(members[0])) is Literal \
                else f"{text} | null"
        return text
    if origin is Literal:
        return "one of: " + ", ".join(_yaml(a) for a in args)
    if origin in (list, set, frozenset, typing.Sequence) or (origin is tuple and len(args) == 2
                                                              and args[1] is Ellipsis):
        return f"list[{type_text(args[0])}]" if args else "list"
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin is dict or tp is dict:
        return f"dict[{type_text(args[0])}, {type_text(args[1])}]" if args else "dict"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


# annotated_types constraints a field may carry, as `name: symbol`.
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <=",
           "multiple_of": "a multiple of"}


def bounds_text(info: FieldInfo) -> str:
    """The bounds pydantic checks (``>= 0, < 1``), from the field's metadata (annotated_types' Ge, Lt, ...)."""
    out = []
    for meta in info.metadata:
        for attr, symbol in _BOUNDS.items():
            value = getattr(meta, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append(f"{symbol} {_yaml(value)}")
    return ", ".join(out)


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    return _yaml(info.get_default(call_default_factory=True))


def prose(text: str | None) -> str:
    """A docstring or description as Markdown: indentation removed, reStructuredText's ``code`` as `code`."""
    if not text:
        return ""
    return re.sub(r"``(.+?)``", r"`\1`", inspect.cleandoc(text)).strip()


def own_doc(cls: type) -> str:
    """The class's own docstring (never one inherited from a base)."""
    return prose(cls.__dict__.get("__doc__"))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# --- the walk -----------------------------------------------------------------------------------------------------


@dataclass
class Row:
    key: str
    type: str
    default: str
    description: str


@dataclass
class Part:
    """One heading of the reference: its title, prose, table, and the parts nested below it."""

    title: str
    level: int
    text: str = ""
    rows: list[Row] = field(default_factory=list)
    children: list[Part] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return slug(self.title)


def _key_title(key: str) -> str:
    return f"`{key}`"


def _rows(fields: dict[str, FieldInfo], prefix: str, level: int, children: list[Part]) -> list[Row]:
    """The table rows of ``fields`` under ``prefix``; nested sections become child parts, linked from their row."""
    rows = []
    for name, info in fields.items():
        key = f"{prefix}{name}"
        nested, item = sections_in(info.annotation), list_item_section(info.annotation)
        if len(nested) == 1 and not item:
            child = section_part(key, nested[0], level + 1)
            optional = _NONE in get_args(_strip(info.annotation))
            kind = "section, or null" if optional else "section"
            rows.append(Row(key, f"{kind}: see [{_key_title(key)}](#{child.anchor})",
                            "" if not optional else _code(default_text(info)), prose(info.description)))
            children.append(child)
        elif len(nested) > 1:
            child = union_part(key, info, nested, level + 1)
            rows.append(Row(key, f"section: see [{_key_title(key)}](#{child.anchor})", "", prose(info.description)))
            children.append(child)
        elif item is not None:
            child = section_part(f"{key}[]", item, level + 1)
            rows.append(Row(key, f"list of [{_key_title(key + '[]')}](#{child.anchor}) entries",
                            _code(default_text(info)), prose(info.description)))
            children.append(child)
        else:
            kind = _code(type_text(info.annotation))
            bounds = bounds_text(info)
            rows.append(Row(key, f"{kind}, {_cell(bounds)}" if bounds else kind, _code(default_text(info)),
                            prose(info.description)))
    return rows


def section_part(key: str, cls: type[BaseModel], level: int) -> Part:
    part = Part(_key_title(key), level, own_doc(cls))
    part.rows = _rows(cls.model_fields, f"{key}.", level, part.children)
    return part


def _discriminator(classes: list[type[BaseModel]]) -> str | None:
    """The field telling a union's classes apart: in every class, a ``Literal`` of one value, a different one each."""
    for name in classes[0].model_fields:
        values = []
        for cls in classes:
            info = cls.model_fields.get(name)
            tp = _strip(info.annotation) if info is not None else None
            if tp is None or get_origin(tp) is not Literal or len(get_args(tp)) != 1:
                break
            values.append(get_args(tp)[0])
        else:
            if len(set(values)) == len(values):
                return name
    return None


def _same(a: FieldInfo, b: FieldInfo) -> bool:
    return (repr(a.annotation), repr(a.metadata), a.description, default_text(a)) == \
        (repr(b.annotation), repr(b.metadata), b.description, default_text(b))


def _common_base_doc(classes: list[type[BaseModel]]) -> str:
    for base in classes[0].__mro__:
        if base is BaseModel or not all(issubclass(c, base) for c in classes):
            continue
        doc = own_doc(base)
        if doc:
            return doc
    return ""


def union_part(key: str, info: FieldInfo, classes: list[type[BaseModel]], level: int) -> Part:
    """A section that is one of several classes (``model``, by ``backend``; ``objective``, by ``name``): the keys all
    share, then each one's."""
    tag = _discriminator(classes)
    part = Part(_key_title(key), level, _common_base_doc(classes))
    first = classes[0].model_fields
    common = {n: f for n, f in first.items() if n != tag
              and all(n in c.model_fields and _same(f, c.model_fields[n]) for c in classes)}
    values = {cls: get_args(_strip(cls.model_fields[tag].annotation))[0] for cls in classes} if tag else {}
    rows = []
    if tag:
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        rows.append(Row(f"{key}.{tag}", _code(type_text(Literal[tuple(values.values())])),
                        _code(_yaml(getattr(default, tag))) if isinstance(default, BaseModel) else "",
                        prose(first[tag].description)))
        choice = ", ".join(f"[`{_yaml(v)}`](#{slug(_variant_title(key, tag, v))})" for v in values.values())
        picks = (f"`{key}.{tag}` ({choice}) picks the keys that apply: those below apply to every `{tag}`, then "
                 f"each `{tag}` has keys of its own.")
        part.text = "\n\n".join(x for x in (part.text, picks) if x)
    part.rows = rows + _rows(common, f"{key}.", level, part.children)
    shown = set()  # a nested section several classes hold (objective.rewards[]) is shown once, under the first
    for cls in classes:
        title = _variant_title(key, tag, values[cls]) if tag else f"`{key}`: {cls.__name__}"
        child = Part(title, level + 1, own_doc(cls))
        own = {n: f for n, f in cls.model_fields.items() if n != tag and n not in common}
        child.rows = _rows(own, f"{key}.", level + 1, child.children)
        child.children = [c for c in child.children if c.title not in shown]
        shown.update(c.title for c in child.children)
        part.children.append(child)
    return part


def _variant_title(key: str, tag: str, value: Any) -> str:
    return f"`{key}` with `{tag}: {_yaml(value)}`"


def parts(config: type[BaseModel] = Config) -> list[Part]:
    """The reference's headings: the top-level keys, then one per section in the config's field order."""
    top = {n: f for n, f in config.model_fields.items()
           if not sections_in(f.annotation) and list_item_section(f.annotation) is None}
    out = []
    if top:
        part = Part("Top level", 2, own_doc(config))
        part.rows = _rows(top, "", 2, part.children)
        out.append(part)
    for name, info in config.model_fields.items():
        if name in top:
            continue
        holder: list[Part] = []
        _rows({name: info}, "", 1, holder)
        out.extend(holder)
    return out


def _walk(items: list[Part]) -> Iterator[Part]:
    for p in items:
        yield p
        yield from _walk(p.children)


def _render_part(p: Part) -> str:
    lines = [f"{'#' * min(p.level, 6)} {p.title}", ""]
    if p.text:
        lines += [p.text, ""]
    if p.rows:
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        lines += [f"| `{r.key}` | {r.type} | {r.default} | {_cell(r.description)} |" for r in p.rows]
        lines.append("")
    return "\n".join(lines)


def render(config: type[BaseModel] = Config) -> str:
    """The whole reference as Markdown."""
    tree = parts(config)
    contents = "\n".join(f"{'  ' * (p.level - 2)}- [{p.title}](#{p.anchor})" for p in _walk(tree) if p.level <= 3)
    body = "\n".join(_render_part(p) for p in _walk(tree))
    return f"{HEADER}\n{INTRO}\n\n{contents}\n\n{body}".rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxtune.config.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="PATH", help="write the reference to PATH (e.g. docs/config.md) instead of "
                    "printing it")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        path = Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({len(text.encode())} bytes)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
