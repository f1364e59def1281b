"""Multi-turn rollouts' tools, on the training side: the worker process that runs them (`ToolWorker`), the tool calls
read from the model's text (`parse_tool_calls`, in the chat template's own format), and the tokens a tool's result
adds to the trajectory (`tool_suffix_ids`).

**Where tools run.** In a worker process (`jaxtune.rollout.tool_worker`, the user's module imported there and nowhere
else): a tool that raises, returns something other than a string or takes longer than ``objective.tool_timeout``
seconds gives the model an error message as its result, counted as a failure; a worker that hangs or dies (a
segfault, an out-of-memory kill) is killed and started again, and each live rollout's environment is rebuilt by
replaying its ``reset`` and its calls so far, so neither the step nor the run is lost.

**Tool calls.** Each chat template family writes calls its own way; the style is read off the template
(`call_style`): ``hermes`` (Qwen 2.5/3, and jaxtune's shipped ``chatml-tools``: ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, one block per call), ``llama3`` (the whole turn one JSON object
``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>`` or not) and ``mistral`` (``[TOOL_CALLS]`` then a
JSON list, or ``name[ARGS]{...}``). A tokenizer whose config carries transformers' ``response_template`` (the
declarative reading of a reply that ``tokenizer.parse_response`` follows) is read by transformers' own parser
instead (``response_template``), so a template family jaxtune does not know is read as transformers reads it. A call
that cannot be read (bad JSON, no name) is the model's mistake: it gets an
error message as the result and the call counts as failed; the rollout goes on.

**Tool results** are rendered by the chat template as ``tool`` messages after the assistant's turn, as TRL 1.16
does (`tool_suffix_ids`: the template's tokens between the end of the assistant's turn and the next generation
prompt), so the trajectory is exactly what the template would render for the whole conversation.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from jaxtune.config import ConfigError
from jaxtune.data import Tokenizer
from jaxtune.tool_schema import SchemaError, module_name

CALL_STYLES = ("hermes", "llama3", "mistral", "response_template")


class ToolError(ConfigError):
    """The tools module cannot be used at all (it does not load, a tool cannot be described): stops the run before
    its first step, one line naming ``objective.tools``."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # a dict when well formed; what the worker is handed as keyword arguments


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn's text read for tool calls: ``content`` (the text besides the calls), the ``calls`` and,
    for each call that could not be read, why (the model's mistake, answered with an error message)."""

    content: str
    calls: list[ToolCall]
    malformed: list[str]

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.malformed)


def call_style(template: str | None, response_template: dict[str, Any] | None = None) -> str:
    """How the chat template writes tool calls (`CALL_STYLES`; transformers' ``response_template`` first, where the
    tokenizer has one); a `ToolError` when it writes none."""
    if response_template is not None:
        return "response_template"
    if template and "<tool_call>" in template:
        return "hermes"
    if template and "[TOOL_CALLS]" in template:
        return "mistral"
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3"
    raise ToolError("objective.tools needs a chat template that renders tool calls and tool results (Qwen 2.5/3's, "
                    "Llama 3.x's, Mistral's); set data.chat_template: chatml-tools (ChatML with Hermes-style "
                    "<tool_call> blocks) or the model's own template")


def _one_call(text: str, arguments_key: str = "arguments") -> tuple[ToolCall | None, str | None]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'a tool call is a JSON object with a "name" string'
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"the arguments of {obj['name']} are not a JSON object"
    return ToolCall(obj["name"], args), None


def parse_tool_calls(text: str, style: str, response_template: dict[str, Any] | None = None) -> ParsedTurn:
    """The tool calls in one assistant turn's ``text`` (its stop token left out), written in ``style``
    (``response_template``: read by transformers' parser with that template)."""
    if style == "response_template":
        return _parsed_by_transformers(text, response_template)
    if style == "hermes":
        calls, malformed = [], []
        for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
            call, why = _one_call(block.strip())
            calls.append(call) if call else malformed.append(why)
        return ParsedTurn(re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.DOTALL).strip(), calls,
                          malformed)
    if style == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedTurn(text.strip(), [], [])
        call, why = _one_call(body, "parameters")
        return ParsedTurn("", [call] if call else [], [why] if why else [])
    if style == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return ParsedTurn(text.strip(), [], [])
        rest = rest.strip()
        if rest.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": ...}, ...]
            try:
                items = json.loads(rest)
            except json.JSONDecodeError as e:
                return ParsedTurn(head.strip(), [], [f"the tool calls are not valid JSON ({e.msg})"])
            parsed = [_one_call(json.dumps(x)) for x in (items if isinstance(items, list) else [items])]
        else:  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            parsed = []
            for part in rest.split("[TOOL_CALLS]"):
                name, sep, args = part.partition("[ARGS]")
                parsed.append(_one_call(json.dumps({"name": name.strip(), "arguments": args.strip()}))
                              if sep else (None, "a tool call is the tool's name, [ARGS], then its JSON arguments"))
        return ParsedTurn(head.strip(), [c for c, _ in parsed if c], [w for _, w in parsed if w])
    raise ValueError(f"unknown tool-call style {style!r} (one of {CALL_STYLES})")


def _parsed_by_transformers(text: str, response_template: dict[str, Any] | None) -> ParsedTurn:
    """``text`` read as transformers' ``tokenizer.parse_response`` reads it (the turn from its start: no prefix).
    A call whose arguments its parser cannot read (it raises, or leaves them a string) is malformed."""
    from transformers.utils.chat_parsing import parse_response  # slow import, only for such tokenizers

    try:
        message = parse_response(text, response_template, prefix="")
    except Exception as e:  # noqa: BLE001 (the model's text, not the run, is at fault)
        why = str(e).splitlines()[0] if str(e) else repr(e)
        return ParsedTurn(text.strip(), [], [f"the reply could not be read: {why}"])
    calls, malformed = [], []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        name, args = function.get("name"), function.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                malformed.append(f"the arguments of {name} are not a JSON object")
                continue
        if not isinstance(name, str) or not isinstance(args, dict):
            malformed.append('a tool call is a "name" string and an object of arguments')
            continue
        calls.append(ToolCall(name, args))
    content = message.get("content")
    return ParsedTurn(content.strip() if isinstance(content, str) else "", calls, malformed)


def tool_suffix_ids(tokenizer: Tokenizer, tool_messages: list[dict[str, Any]], stops: list[int]) -> list[int]:
    """The ids the template puts after an assistant turn that called tools: the ``tool_messages`` rendered, then
    the next generation prompt. TRL 1.16's way (``_get_tool_suffix_ids``): a short conversation (a user turn, an
    assistant turn calling the first message's tool) rendered without and with the tool messages; the first cut
    after its last end-of-turn token (``stops``), the suffix what the second adds."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix, full = tokenizer.encode_chat([tokenizer.apply_chat_template(head),
                                          tokenizer.apply_chat_template(head + tool_messages,
                                                                        add_generation_prompt=True)])
    ends = [i for i, t in enumerate(prefix) if t in set(stops)]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ToolError("the chat template renders an assistant turn differently once tool messages follow it; "
                        "multi-turn rollouts need a template whose conversation prefixes are kept")
    return full[len(prefix):]


def failure(message: str) -> str:
    """A failed tool call's result as the model reads it (TRL's form: the repr of ``{"error": message}``)."""
    return str({"error": message})


@dataclass
class _Rollout:
    environment: str
    row: dict[str, Any]
    calls: list[tuple[str, Any]] = field(default_factory=list)  # the calls that ran, for a restarted worker


class ToolWorker:
    """The tools module served by a worker process (`jaxtune.rollout.tool_worker`), with a time limit per request.

    A request that times out, or finds the worker dead, kills it and starts a new one, rebuilds the live rollouts'
    environments there (their ``reset`` and the calls that ran, replayed), and answers the request as a failure."""

    def __init__(self, module: str, timeout: float):
        try:  # a file's path is refused before a worker is started for it
            self.module = module_name(module, "objective.tools")
        except SchemaError as e:
            raise ToolError(f"objective.tools={module!r}: {e}") from None
        self.timeout = timeout
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._live: dict[int, _Rollout] = {}
        self.description = self._start()

    def _start(self) -> dict[str, Any]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *[p for p in sys.path if p]])}
        self._proc = subprocess.Popen([sys.executable, "-m", "jaxtune.rollout.tool_worker", self.module],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buffer = b""
        ready = self._answer(max(self.timeout, 60.0))
        if ready is None or "error" in ready:
            self.close()
            where = (f"; it is imported from the current directory ({os.getcwd()}) and the installed packages"
                     if ready is None or not ready.get("imported") else "")
            why = ready["error"] if ready else "its worker did not start"
            raise ToolError(f"objective.tools={self.module!r}: {why}{where}")
        described = self._request({"op": "describe"}, max(self.timeout, 60.0))
        if described is None or "error" in described:
            self.close()
            raise ToolError(f"objective.tools={self.module!r}: {described['error'] if described else 'timed out'}")
        return described["ok"]

    def _answer(self, timeout: float) -> dict[str, Any] | None:
        """The worker's next answer line, or None when it does not come within ``timeout`` s or the worker died."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def _request(self, request: dict[str, Any], timeout: float | None = None) -> dict[str, Any] | None:
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self._answer(self.timeout if timeout is None else timeout)

    def _restart(self) -> None:
        """A new worker, with every live rollout's environment rebuilt there; a rollout whose replay fails again
        is dropped (its next call fails) and the worker started once more for the others."""
        while True:
            self.close()
            self.restarts += 1
            self.description = self._start()
            lost = self._replay()
            if lost is None:
                return
            self._live.pop(lost)

    def _replay(self) -> int | None:
        """Each live rollout's ``reset`` and calls so far, again; the first rollout whose replay got no answer."""
        for rid, r in self._live.items():
            ok = self._request({"op": "reset", "rollout": rid, "environment": r.environment, "row": r.row})
            for name, arguments in r.calls:
                if ok is None:
                    break
                ok = self._request({"op": "call", "rollout": rid, "name": name, "arguments": arguments})
            if ok is None:
                return rid
        return None

    def reset(self, rollout: int, environment: str, row: dict[str, Any]) -> str | None:
        """A rollout's environment made and reset with its row: the text to append to the last user message."""
        self._live[rollout] = _Rollout(environment, row)
        got = self._request({"op": "reset", "rollout": rollout, "environment": environment, "row": row})
        if got is None:
            self._restart()
            raise ToolError(f"environment {environment or '(the module environment)'}: reset() took longer than "
                            f"objective.tool_timeout={self.timeout} s or crashed its worker")
        if "error" in got:
            raise ToolError(f"environment {environment or '(the module environment)'}: reset() failed: {got['error']}")
        return got["ok"]

    def call(self, rollout: int, call: ToolCall) -> tuple[str, bool]:
        """(the result the model reads, whether the call failed) of one tool call of a rollout. A failure reads
        as TRL's loop writes it, ``{'error': '...'}``, so a model sees what it would see there."""
        got = self._request({"op": "call", "rollout": rollout, "name": call.name, "arguments": call.arguments})
        if got is None:
            self._restart()
            return failure(f"tool {call.name} did not answer within {self.timeout} s, or its process died, and was "
                           "stopped"), True
        if "error" in got:
            return failure(got["error"]), True
        if isinstance(got["ok"], dict):
            return failure(got["ok"]["failed"]), True
        if rollout in self._live:
            self._live[rollout].calls.append((call.name, call.arguments))
        return got["ok"], False

    def reward(self, rollout: int) -> tuple[float | None, str | None]:
        """(the rollout's environment's ``get_reward()``, None when it has none; why it failed, None when it did
        not): NaN and what went wrong (what it returned or raised, or that it hung) when it failed."""
        got = self._request({"op": "reward", "rollout": rollout})
        if got is None:
            self._restart()
            return float("nan"), (f"did not answer within objective.tool_timeout={self.timeout} s, or its process "
                                  "died")
        if "error" in got:
            return float("nan"), f"failed in the tools' worker ({got['error']})"
        if isinstance(got["ok"], dict):
            return float("nan"), got["ok"]["failed"]
        return got["ok"], None

    def live_environment(self, rollout: int) -> str | None:
        """The environment a live rollout was reset in (None: no such rollout)."""
        r = self._live.get(rollout)
        return None if r is None else r.environment

    def drop(self) -> None:
        """Lets every live rollout's environment go (at the end of a rollout batch)."""
        if self._live:
            self._request({"op": "drop", "rollouts": list(self._live)})
        self._live.clear()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc is not None:
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
        self._proc = None
