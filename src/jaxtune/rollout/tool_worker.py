"""The process that runs a multi-turn rollout's tools and environments (`jaxtune.rollout.tools.ToolWorker` starts it:
``python -m jaxtune.rollout.tool_worker MODULE``), so that a tool that leaks, hangs or crashes cannot take the training
process with it. Standard library only: it never imports JAX.

``MODULE`` is the user's Python module, in TRL's conventions (``GRPOTrainer(tools=..., environment_factory=...)``):
``tools``, a list of plain typed functions with Google-style docstrings; ``environment`` (or TRL's name
``environment_factory``), a class (or any callable returning an instance) or a dict of them by name, selected by a
row's ``environment`` field. An environment's ``reset(**row)`` returns None or text to append to the last user
message; its public methods are tools; an optional ``get_reward()`` owns the reward. One instance per rollout.

Requests and answers are JSON lines on stdin/stdout (the user's own prints go to stderr): ``{"op": ...}`` ->
``{"ok": value}`` or ``{"error": text}``. Ops: ``describe`` (each environment's tool schemas, as transformers'
``get_json_schema`` makes them, and which own a reward), ``reset`` (a rollout's instance made and reset), ``call``
(one tool call of a rollout: the tool's string result, or ``{"failed": text}``), ``reward`` (``get_reward()``'s
number, or ``{"failed": text}`` saying what it returned or raised), ``drop`` (the rollouts' instances let go). The
first line the worker writes is ``{"ok": "ready"}``, or ``{"error": text, "imported": bool}``: the module did not
import, or it did and is not shaped as above (`ModuleShapeError`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import numbers
import sys
import traceback
from collections.abc import Callable
from typing import Any

from jaxtune.tool_schema import tool_schema

# The environment's name a module without a dict of environments uses (TRL's ``None`` key).
SINGLE = ""


class ModuleShapeError(TypeError):
    """The tools module imported but its ``tools`` or ``environment`` is not what the worker can serve; the message
    says what it is and what to write."""


def _short(value: Any) -> str:
    """``value``'s repr, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _factory(value: Any, name: str) -> Callable[[], Any]:
    """An environment factory (``name``: where the module holds it), refused unless it can be called."""
    if not callable(value):
        raise ModuleShapeError(f"`{name}` is {type(value).__name__} ({_short(value)}), not a class or function: set "
                               f"{name} = MyEnvironment, a class whose instances have reset(**row) (or a dict of "
                               "such classes by name)")
    return value


def _awaited(value: Any) -> Any:
    """An async tool's (or ``get_reward``'s) result, run to its end (TRL runs async tools too)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def _methods(instance: Any) -> dict[str, Callable[..., Any]]:
    """An environment's tools: its class's public functions besides ``reset`` and ``get_reward``."""
    return {n: getattr(instance, n) for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if not n.startswith("_") and n not in ("reset", "get_reward")}


class Host:
    """The worker's state: the module's tools and environment factories, and each live rollout's instance."""

    def __init__(self, module: Any):
        tools = getattr(module, "tools", None) or []
        if not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools):
            raise ModuleShapeError(f"`tools` is {type(tools).__name__} ({_short(tools)}), not a list of functions: "
                                   "set tools = [my_function, ...]")
        self.tools = {t.__name__: t for t in tools}
        key = "environment" if getattr(module, "environment", None) is not None else "environment_factory"
        factory = getattr(module, key, None)
        self.factories: dict[str, Callable[[], Any]] = {} if factory is None else (
            {str(k): _factory(v, f"{key}[{k!r}]") for k, v in factory.items()} if isinstance(factory, dict)
            else {SINGLE: _factory(factory, key)})
        if not self.tools and not self.factories:
            raise ModuleShapeError("it names neither `tools` (a list of functions) nor `environment` (a class, or a "
                                   "dict of them)")
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
            result = _awaited(tools[name](**arguments))
        except Exception as e:  # noqa: BLE001 (the tool's failure is the model's to read, not the run's)
            return {"failed": str(e)}  # what TRL's loop tells the model
        if not isinstance(result, str):
            return {"failed": f"tool {name} returned a {type(result).__name__}, not a string"}
        return result

    def reward(self, rollout: int) -> float | dict[str, str] | None:
        """The rollout's ``get_reward()`` (None: its environment has none), or ``{"failed": why}`` when it raised or
        returned anything but a finite number."""
        instance, _ = self.live[rollout]
        get = getattr(instance, "get_reward", None)
        if get is None:
            return None
        try:
            r = _awaited(get())
        except Exception as e:  # noqa: BLE001 (the user's code: said in the run's error, naming the function)
            why = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return {"failed": f"raised {type(e).__name__}" + (f": {why}" if why else "")}
        if not isinstance(r, numbers.Real) or not math.isfinite(r):
            kind = "a non-finite number" if isinstance(r, numbers.Real) else f"a {type(r).__name__}"
            said = "None" if r is None else f"{kind} ({_short(r)})"
            return {"failed": f"returned {said}; it must return the rollout's score, a finite number"}
        return float(r)

    def drop(self, rollouts: list[int]) -> None:
        for r in rollouts:
            self.live.pop(r, None)


def serve(module_name: str, stdin: Any, stdout: Any) -> None:
    """Answers requests from ``stdin`` on ``stdout`` until stdin closes."""
    host, ready = None, {"ok": "ready"}
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 (said to the trainer, which stops naming the module)
        module, ready = None, {"error": f"it does not import ({type(e).__name__}: {e})", "imported": False}
    if module is not None:
        try:
            host = Host(module)
        except ModuleShapeError as e:
            ready = {"error": str(e), "imported": True}
        except Exception as e:  # noqa: BLE001 (the user's code, run while the module was read)
            ready = {"error": f"{type(e).__name__}: {e}", "imported": True}
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
