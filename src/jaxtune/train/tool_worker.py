"""The process that runs a multi-turn rollout's tools and environments (`jaxtune.train.tools.ToolWorker` starts it:
``python -m jaxtune.train.tool_worker MODULE``), so that a tool that leaks, hangs or crashes cannot take the training
process with it. Standard library only: it never imports JAX.

``MODULE`` is the user's Python module, in TRL's conventions (``GRPOTrainer(tools=..., environment_factory=...)``):
``tools``, a list of plain typed functions with Google-style docstrings; ``environment`` (or TRL's name
``environment_factory``), a class (or any callable returning an instance) or a dict of them by name, selected by a
row's ``environment`` field. An environment's ``reset(**row)`` returns None or text to append to the last user
message; its public methods are tools; an optional ``get_reward()`` owns the reward. One instance per rollout.

Requests and answers are JSON lines on stdin/stdout (the user's own prints go to stderr): ``{"op": ...}`` ->
``{"ok": value}`` or ``{"error": text}``. Ops: ``describe`` (each environment's tool schemas, as transformers'
``get_json_schema`` makes them, and which own a reward), ``reset`` (a rollout's instance made and reset), ``call``
(one tool call of a rollout: the tool's string result, or ``{"failed": text}``), ``reward`` (``get_reward()``),
``drop`` (the rollouts' instances let go).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import traceback
import types
import typing
from collections.abc import Callable
from typing import Any

# The environment's name a module without a dict of environments uses (TRL's ``None`` key).
SINGLE = ""


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


def _methods(instance: Any) -> dict[str, Callable[..., Any]]:
    """An environment's tools: its class's public functions besides ``reset`` and ``get_reward``."""
    return {n: getattr(instance, n) for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if not n.startswith("_") and n not in ("reset", "get_reward")}


class Host:
    """The worker's state: the module's tools and environment factories, and each live rollout's instance."""

    def __init__(self, module: Any):
        tools = getattr(module, "tools", None) or []
        if not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools):
            raise TypeError(f"{module.__name__}.tools must be a list of functions")
        self.tools = {t.__name__: t for t in tools}
        factory = getattr(module, "environment", None) or getattr(module, "environment_factory", None)
        self.factories: dict[str, Callable[[], Any]] = {} if factory is None else (
            {str(k): v for k, v in factory.items()} if isinstance(factory, dict) else {SINGLE: factory})
        if not self.tools and not self.factories:
            raise TypeError(f"{module.__name__} names neither `tools` (a list of functions) nor `environment` (a "
                            "class, or a dict of them)")
        self.live: dict[int, tuple[Any, dict[str, Callable[..., Any]]]] = {}

    def describe(self) -> dict[str, Any]:
        envs: dict[str, Any] = {}
        for name, factory in (self.factories or {SINGLE: None}).items():
            instance = factory() if factory is not None else None
            if instance is not None and not callable(getattr(instance, "reset", None)):
                raise TypeError(f"environment {name or type(instance).__name__!r} has no reset(**row) method")
            methods = {**self.tools, **(_methods(instance) if instance is not None else {})}
            envs[name] = {"tools": [tool_schema(f) for f in methods.values()],
                          "reward": type(instance).__name__ if callable(getattr(instance, "get_reward", None))
                          else None}
        return {"environments": envs, "named": bool(self.factories) and SINGLE not in self.factories}

    def reset(self, rollout: int, environment: str, row: dict[str, Any]) -> str | None:
        factory = self.factories.get(environment)
        if factory is None:
            self.live[rollout] = (None, dict(self.tools))
            return None
        instance = factory()
        self.live[rollout] = (instance, {**self.tools, **_methods(instance)})
        observation = instance.reset(**row)
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"reset() returned a {type(observation).__name__}; it returns None or text")
        return observation

    def call(self, rollout: int, name: str, arguments: Any) -> Any:
        tools = self.live[rollout][1]
        if name not in tools:
            return {"failed": f"Tool {name} not found."}  # TRL's words
        if not isinstance(arguments, dict):
            return {"failed": f"the arguments of {name} must be a JSON object, not {type(arguments).__name__}"}
        try:
            result = tools[name](**arguments)
        except Exception as e:  # noqa: BLE001 (the tool's failure is the model's to read, not the run's)
            return {"failed": str(e)}  # what TRL's loop tells the model
        if not isinstance(result, str):
            return {"failed": f"tool {name} returned a {type(result).__name__}, not a string"}
        return result

    def reward(self, rollout: int) -> float | None:
        instance, _ = self.live[rollout]
        get = getattr(instance, "get_reward", None)
        return None if get is None else (None if (r := get()) is None else float(r))

    def drop(self, rollouts: list[int]) -> None:
        for r in rollouts:
            self.live.pop(r, None)


def serve(module_name: str, stdin: Any, stdout: Any) -> None:
    """Answers requests from ``stdin`` on ``stdout`` until stdin closes."""
    try:
        host = Host(importlib.import_module(module_name))
        ready: dict[str, Any] = {"ok": "ready"}
    except Exception as e:  # noqa: BLE001 (said to the trainer, which stops naming the module)
        host, ready = None, {"error": f"cannot load tools module {module_name!r}: {type(e).__name__}: {e}"}
    stdout.write(json.dumps(ready) + "\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            answer = {"ok": getattr(host, op)(**request)}
        except Exception as e:  # noqa: BLE001 (the user's code: answered, never fatal here)
            answer = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # the tools' own prints must not mix with the answers
    sys.path.insert(0, "")
    serve(sys.argv[1], sys.stdin, out)


if __name__ == "__main__":
    main()
