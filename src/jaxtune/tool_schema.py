"""A Python function as the JSON schema a chat template shows the model (transformers' ``get_json_schema``):
its name, its docstring's description, a typed property per parameter with its ``Args:`` description, the
parameters without a default required, and its return type (`tool_schema`); a module's ``tools`` list described
(`module_schemas`). Standard library only (a tools worker imports it)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from typing import Any


class SchemaError(ValueError):
    """A tool whose signature or docstring cannot be described as a JSON schema."""


_SIMPLE = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a type hint, as transformers' ``get_json_schema`` writes it."""
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    if hint is Any or hint is inspect.Parameter.empty:
        return {}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        out = _json_type(rest[0], where) if len(rest) == 1 else {"type": [_json_type(a, where)["type"]
                                                                           for a in rest]}
        if len(rest) < len(args):
            out["nullable"] = True
        return out
    if origin is typing.Literal:
        kinds = {_SIMPLE[type(a)] for a in args}
        return {"type": kinds.pop() if len(kinds) == 1 else sorted(kinds), "enum": list(args)}
    if hint is list or origin is list:
        return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
    if hint is dict or origin is dict:
        return {"type": "object", **({"additionalProperties": _json_type(args[1], where)} if args else {})}
    if hint is tuple or origin is tuple:
        return {"type": "array", **({"prefixItems": [_json_type(a, where) for a in args]} if args else {})}
    raise SchemaError(f"{where}: type {hint!r} has no JSON schema; use int, float, str, bool, list, dict, Literal "
                      "or an optional of one")


def _docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {argument: its description}, the Returns section) of a Google-style docstring."""
    doc = inspect.cleandoc(doc)
    head = re.split(r"^\s*(?:Args|Arguments|Returns|Raises):\s*$", doc, maxsplit=1, flags=re.MULTILINE)[0]
    args: dict[str, str] = {}
    section = re.search(r"^\s*(?:Args|Arguments):\s*\n(.*?)(?=^\s*(?:Returns|Raises):\s*$|\Z)", doc,
                        re.DOTALL | re.MULTILINE)
    if section:
        current, indent = None, None
        for line in section.group(1).splitlines():
            depth = len(line) - len(line.lstrip())
            m = re.match(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if m and (indent is None or depth <= indent):  # a new argument, at the first one's indent
                current, indent = m.group(1), depth
                args[current] = m.group(2).strip()
            elif current is not None and line.strip():  # its description continued
                args[current] = f"{args[current]} {line.strip()}".strip()
    returns = re.search(r"^\s*Returns:\s*\n(.*?)(?=^\s*Raises:\s*$|\Z)", doc, re.DOTALL | re.MULTILINE)
    said = " ".join(x.strip() for x in returns.group(1).splitlines() if x.strip()) if returns else None
    return head.strip(), args, said


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s JSON schema as transformers' ``get_json_schema`` makes it (its name, its docstring's description, a
    property per parameter with its type and its ``Args:`` description, the parameters without a default required,
    and the return type), which chat templates render into the prompt. A parameter without a type hint or a
    description is a `SchemaError` naming it."""
    name = getattr(fn, "__name__", type(fn).__name__)
    if not fn.__doc__:
        raise SchemaError(f"tool {name!r} has no docstring: describe it and each argument (Google style: Args:)")
    description, said, returns = _docstring(fn.__doc__)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in hints:
            raise SchemaError(f"tool {name!r}: argument {p.name!r} has no type hint")
        if p.name not in said:
            raise SchemaError(f"tool {name!r}: argument {p.name!r} is not described in its docstring's Args:")
        properties[p.name] = {**_json_type(hints[p.name], f"tool {name!r} argument {p.name!r}"),
                              "description": said[p.name]}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    function: dict[str, Any] = {"name": name, "description": description,
                                "parameters": {"type": "object", "properties": properties, "required": required}}
    if "return" in hints:
        function["return"] = {**_json_type(hints["return"], f"tool {name!r} return"),
                              **({"description": returns} if returns else {})}
    return {"type": "function", "function": function}


def module_name(module: str, key: str) -> str:
    """``module``, the value of the config ``key`` (``data.tools``, ``objective.tools``), when it is a module's name;
    a file path (``my_tools.py``, ``./tools/my_tools.py``) is a `SchemaError` that gives the name to write instead
    (``my_tools``, ``tools.my_tools``): both keys import the module by its name, from the current directory and the
    installed packages, and say so in the same words."""
    if not (module.endswith(".py") or os.sep in module or "/" in module):
        return module
    path = os.path.normpath(os.path.splitext(module)[0] if module.endswith(".py") else module)
    parts = path.split(os.sep)
    if os.path.isabs(path) or ".." in parts:  # outside the current directory: only its file name can be imported
        name, where = parts[-1], f"; run from {os.path.dirname(path) or os.sep}, where it is, or put it on PYTHONPATH"
    else:
        name, where = ".".join(parts), ""
    raise SchemaError(f"name the module, not its file: {key}={name} (it is imported from the current directory and "
                      f"the installed packages{where})")


def module_schemas(module: str, cwd: str | None = None, key: str = "data.tools") -> list[dict[str, Any]]:
    """The schemas (`tool_schema`) of the tools ``module`` (the value of the config ``key``) lists in ``tools``,
    imported by its name from ``cwd`` (default the current directory) and the installed packages. A module given as
    a file path (`module_name`), one that does not load, or one with no ``tools`` list is a `SchemaError` that says
    what to write instead."""
    module_name(module, key)
    where = cwd or os.getcwd()
    added = where not in sys.path
    if added:
        sys.path.insert(0, where)
    try:
        loaded = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (the user's module: any error it raises while importing is theirs)
        raise SchemaError(f"module {module!r} does not import ({type(e).__name__}: {e}); it is imported from {where} "
                          "and the installed packages") from None
    finally:
        if added:
            sys.path.remove(where)
    tools = getattr(loaded, "tools", None)
    if not isinstance(tools, (list, tuple)) or not tools or not all(callable(t) for t in tools):
        raise SchemaError(f"module {module!r} has no `tools` list of functions (tools = [my_function, ...])")
    return [tool_schema(t) for t in tools]
