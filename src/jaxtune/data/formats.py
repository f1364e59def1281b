"""Fine-tuning row formats: how a row (`jaxtune.data.rows`) reads as an `Example`, one `Format` record each.

``data.format`` names the format (field names can be renamed with ``data.fields``):

* ``messages``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` (OpenAI chat);
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}`` (``data.roles``
  maps other speaker names);
* ``alpaca``: ``{"instruction", "input" (optional), "output", "system" (optional)}``: one user turn
  (instruction, then the input after a blank line) and the assistant's output;
* ``prompt_completion``: ``{"prompt", "completion"}``: raw text, no chat template, completion then EOS;
* ``preference``: pairs of completions, one preferred, in TRL's three forms (a `Pair`, `jaxtune.data.preference`):
  ``{"prompt": str, "chosen": str, "rejected": str}`` (raw text, as ``prompt_completion``);
  ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` (the prompt ends with a user turn, each
  completion starts with the assistant's); ``{"chosen": [messages], "rejected": [messages]}`` (implicit prompt: the
  longest run of leading messages the two share). Messages are ``role``/``content`` objects.
* ``prompts``: prompts alone, for objectives that generate their completions (a `Prompt`, `jaxtune.data.prompts`),
  in TRL's forms: ``{"prompt": str}`` (raw text, no chat template); ``{"prompt": [messages]}`` (ending with a user
  turn); or ``{"messages": [messages]}`` ending with a user turn, or with an assistant turn, which is then not part
  of the prompt but its reference answer. Every other field of the row (``answer``...) is kept for the rewards.

A conversation is an optional system message, then user and assistant turns alternating, starting with the user
and ending with the assistant (a prompt: with the user), every content a non-empty string. A row that is not valid
UTF-8, not JSON, lacks a field, names an unknown role, breaks the order or has an empty content (a pair also: equal
completions, or an implicit prompt that is not one) is *bad*: ``data.bad_rows=raise`` stops with its file:line,
``drop`` skips it and counts it per reason (`REASONS`).

A new format is one `Format` (its fields, the key that detects it, its parser, its bad-row reasons), registered in
`FORMATS` with `register_format`: the formats of the batch kinds here are registered below; a new batch kind's data
module registers its own (and its name is one of its kind's formats, `jaxtune.config.kinds`). When its `Example` is
not a conversation or a prompt/completion it needs an encoder (`jaxtune.data.sft`, `jaxtune.data.preference`,
`jaxtune.data.prompts`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxtune.config import PAIRS, UNPAIRED, DataConfig
from jaxtune.config.kinds import KIND_OF_FORMAT, objectives_for
from jaxtune.data.errors import DataError
from jaxtune.data.rows import READ_REASONS, BadRow, file_rows, read_rows
from jaxtune.tool_schema import SchemaError, module_schemas

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """A row understood: ``messages`` for the chat formats, or (``prompt``, ``completion``). ``tools``: the JSON
    schemas of the tools the conversation may call (its ``tools`` column, or ``data.tools``), which the chat template
    renders as ``apply_chat_template(tools=...)`` does."""

    messages: tuple[dict[str, Any], ...] = ()
    prompt: str = ""
    completion: str = ""
    tools: tuple[dict[str, Any], ...] = ()

    def texts(self) -> list[str]:
        return _message_texts(self.messages) if self.messages else [self.prompt, self.completion]


def _message_texts(messages: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[str]:
    """The contents of ``messages``, an assistant's tool calls as their JSON (what a tokenizer trained on the rows
    must cover)."""
    out = []
    for m in messages:
        out.append(m["content"])
        out += [json.dumps(c["function"], ensure_ascii=False) for c in m.get("tool_calls", ())]
    return out


@dataclass(frozen=True)
class Pair:
    """A preference row understood: the same prompt with its ``chosen`` and its ``rejected`` completion, each whole
    (messages, the first ``prompt_turns`` of them the prompt; or prompt and completion text, ``prompt_turns`` 0)."""

    chosen: Example
    rejected: Example
    prompt_turns: int = 0
    margin: float | None = None  # TRL's optional ``margin`` column: how much more the chosen is preferred

    def texts(self) -> list[str]:
        """The prompt's texts once, then each completion's."""
        if not self.chosen.messages:
            return [self.chosen.prompt, self.chosen.completion, self.rejected.completion]
        return _message_texts((*self.chosen.messages, *self.rejected.messages[self.prompt_turns:]))


@dataclass(frozen=True)
class Labelled:
    """An unpaired preference row understood (KTO's): one completion of a prompt (``example``: messages, the first
    ``prompt_turns`` the prompt; or prompt and completion text) and whether it is desirable (``label``)."""

    example: Example
    label: bool
    prompt_turns: int = 0

    def texts(self) -> list[str]:
        return self.example.texts()


@dataclass(frozen=True)
class Prompt:
    """A prompts row understood: the prompt as ``messages`` ending with a user turn, or as raw ``text``; and the row's
    other ``fields`` as they were (``answer``...), with ``reference`` the content of the assistant turn that ended a
    ``messages`` conversation (then dropped from the prompt; it replaces a ``reference`` field of the row)."""

    messages: tuple[dict[str, str], ...] = ()
    text: str = ""
    fields: dict[str, Any] = field(default_factory=dict)

    def texts(self) -> list[str]:
        return _message_texts(self.messages) if self.messages else [self.text]


@dataclass(frozen=True)
class Format:
    """One fine-tuning row format.

    ``fields``: the format's field names by what they hold (``data.fields`` renames them); ``detect_key``: a row
    holding this key is taken to be of this format (`detect_format`, in `FORMATS` order); ``parse(record, fields,
    data_cfg)``: a row (a dict) as an `Example` (a `Pair` for preference rows, a `Prompt` for prompts), or `BadRow`;
    ``reasons``: the `BadRow` reasons ``parse`` gives; ``chat``: rendered with the chat template (else raw text;
    preference and prompts rows are either, by their form); ``detect_last``: detected only when no other format's key
    is in the row (a key that other formats' rows hold too, such as ``prompt``); ``noun``: what one row is, for
    messages (default: a ``name`` row); ``keys``: the fields that make a row this format's (`own_keys`)."""

    name: str
    fields: dict[str, str]
    detect_key: str
    parse: Callable[[dict, dict[str, str], DataConfig], Example | Pair | Prompt | Labelled]
    reasons: tuple[str, ...]
    chat: bool = True
    detect_last: bool = False
    noun: str = ""
    keys: tuple[str, ...] = ()

    @property
    def own_keys(self) -> set[str]:
        """The fields only rows of this format hold (``keys``, default ``detect_key``): a row with none of them is
        another format's (`other_format_hint`), else one of this format's that lost a field."""
        return set(self.keys or (self.detect_key,))

    @property
    def row_noun(self) -> str:
        return self.noun or f"a {self.name} row"


def _string(record: dict, key: str, name: str, required: bool = True) -> str:
    if key not in record or record[key] is None:
        if required:
            raise BadRow("missing_field", f"no {key!r} field (found {sorted(record)})"
                         + (f"; set data.fields.{name} to the field's name" if key == name else ""))
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise BadRow("bad_type", f"field {key!r} is {type(value).__name__}, not a string")
    return value


def _prompt_completion(record: dict, fields: dict[str, str], data_cfg: DataConfig) -> Example:
    if isinstance(record.get("label"), bool):  # fine-tuning on it would train on the disliked completions too
        raise BadRow("wrong_format", f"this row is {FORMATS['unpaired'].row_noun} (data.format=unpaired, for "
                     "objective.name=kto): fine-tuning on it would train on the disliked completions too; train it "
                     "with data.format=unpaired objective.name=kto, or keep the rows labelled true and drop their "
                     "'label' field")
    prompt, completion = _string(record, fields["prompt"], "prompt"), _string(record, fields["completion"],
                                                                             "completion")
    if not completion.strip():
        raise BadRow("empty_content", "the completion is empty")
    return Example(prompt=prompt, completion=completion)


def _alpaca(record: dict, fields: dict[str, str], data_cfg: DataConfig) -> Example:
    instruction = _string(record, fields["instruction"], "instruction")
    extra = _string(record, fields["input"], "input", required=False)
    output = _string(record, fields["output"], "output")
    system = _string(record, fields["system"], "system", required=False)
    if not instruction.strip() or not output.strip():
        raise BadRow("empty_content", f"empty {'instruction' if not instruction.strip() else 'output'}")
    user = instruction + (f"\n\n{extra}" if extra.strip() else "")
    msgs = ([{"role": "system", "content": system}] if system.strip() else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return Example(messages=tuple(msgs))


def _messages(record: dict, fields: dict[str, str], data_cfg: DataConfig) -> Example:
    return _conversation(record, fields, {r: r for r in ROLES}, unknown_role_hint="", data_cfg=data_cfg)


def _sharegpt(record: dict, fields: dict[str, str], data_cfg: DataConfig) -> Example:
    return _conversation(record, fields, {**SHAREGPT_ROLES, **data_cfg.roles},
                         unknown_role_hint="; map it with data.roles", data_cfg=data_cfg)


def _conversation(record: dict, fields: dict[str, str], role_names: dict[str, str],
                  unknown_role_hint: str, ends_with: tuple[str, ...] = ("assistant",),
                  data_cfg: DataConfig | None = None) -> Example:
    """The list of turns under ``fields["messages"]``, each a ``fields["role"]`` (a key of ``role_names``) and a
    ``fields["content"]``, as an `Example` of messages in the order the module docstring gives, the last turn one
    of the roles ``ends_with``; with ``data_cfg``, the tools of the row's ``tools`` column (`row_tools`)."""
    turns = record.get(fields["messages"])
    if turns is None:
        raise BadRow("missing_field", f"no {fields['messages']!r} field (found {sorted(record)}); "
                     "set data.fields.messages to the field holding the conversation")
    if not isinstance(turns, list) or not turns:
        raise BadRow("bad_type", f"{fields['messages']!r} must be a non-empty list of turns")
    msgs = _turns(turns, fields, role_names, unknown_role_hint)
    _check_order(msgs, ends_with)
    return Example(messages=tuple(msgs), tools=row_tools(record, data_cfg) if data_cfg else ())


def _turns(turns: list, fields: dict[str, str], role_names: dict[str, str], unknown_role_hint: str = "",
           what: str = "turn") -> list[dict[str, Any]]:
    """Each turn as ``{"role", "content"}``: an object with a known role and a non-empty string content. An
    assistant turn may carry ``tool_calls`` instead of (or beside) its content (`_tool_calls`); a ``tool`` turn (a
    tool's result) keeps its ``name`` and ``tool_call_id`` and may be empty."""
    msgs = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow("bad_type", f"{what} {k} is {type(turn).__name__}, not an object")
        speaker = _string(turn, fields["role"], "role")
        if speaker not in role_names:
            raise BadRow("unknown_role", f"{what} {k} has role {speaker!r}; known: {sorted(role_names)}"
                         + unknown_role_hint)
        role = role_names[speaker]
        calls = _tool_calls(turn, f"{what} {k}") if role == "assistant" else []
        content = _string(turn, fields["content"], "content", required=not calls)
        if not content.strip() and not calls and role != "tool":
            raise BadRow("empty_content", f"{what} {k} ({speaker}) has empty content")
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            msg.update({key: turn[key] for key in ("name", "tool_call_id") if isinstance(turn.get(key), str)})
        msgs.append(msg)
    return msgs


def _tool_calls(turn: dict, where: str) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` in TRL's and transformers' form, ``{"type": "function", "function":
    {"name": str, "arguments": {...}}}`` (its ``id`` kept; a call without the ``function`` wrapper is read too), the
    arguments a dict (a JSON string of one is parsed: every template then renders them alike). A malformed call is
    a `BadRow` naming it."""
    calls = turn.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise BadRow("bad_tool_call", f"{where}: tool_calls is {type(calls).__name__}, not a list of calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where} tool call {j}"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRow("bad_tool_call", f"{at} has no function name; a call is {{\"type\": \"function\", "
                         "\"function\": {\"name\": ..., \"arguments\": {...}}}")
        name, arguments = function["name"], function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise BadRow("bad_tool_call", f"{at} ({name}): its arguments are not valid JSON ({e.msg} at "
                             f"character {e.pos})") from None
        if not isinstance(arguments, dict):
            raise BadRow("bad_tool_call", f"{at} ({name}): its arguments are {type(arguments).__name__}; they must "
                         "be an object of argument names (or a JSON string of one)")
        out.append({**({"id": call["id"]} if isinstance(call.get("id"), str) else {}), "type": "function",
                    "function": {"name": name, "arguments": arguments}})
    return out


def row_tools(record: dict, data_cfg: DataConfig) -> tuple[dict[str, Any], ...]:
    """The JSON schemas of the tools a row's conversation may call: its ``tools`` column (a list of schemas, a JSON
    string of one as xLAM and ToolACE publish it, or names of ``data.tools``'s tools), or without one every tool of
    ``data.tools``."""
    tools = record.get("tools")
    if tools is None or tools == "" or tools == []:
        return tuple(module_tools(data_cfg.tools)) if data_cfg.tools else ()
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRow("bad_tools", f"'tools' is a string but not JSON ({e.msg} at character {e.pos}); give a "
                         "list of the tools' JSON schemas or names") from None
    if not isinstance(tools, list):
        raise BadRow("bad_tools", f"'tools' is {type(tools).__name__}; give a list of the tools' JSON schemas or names")
    out = []
    for j, tool in enumerate(tools):
        if isinstance(tool, str):
            if not data_cfg.tools:
                raise BadRow("bad_tools", f"tools[{j}] names the tool {tool!r}: set data.tools to the module that "
                             "defines it (one with a `tools` list, e.g. jaxtune.recipe_tools), or give its schema")
            known = {s["function"]["name"]: s for s in module_tools(data_cfg.tools)}
            if tool not in known:
                raise BadRow("bad_tools", f"tools[{j}] names {tool!r}, which data.tools={data_cfg.tools!r} does not "
                             f"define (its tools: {sorted(known)})")
            out.append(known[tool])
        elif isinstance(tool, dict) and isinstance(tool.get("function", tool), dict) \
                and isinstance(tool.get("function", tool).get("name"), str):
            out.append(tool)
        else:
            raise BadRow("bad_tools", f"tools[{j}] is neither a tool's JSON schema (with a function name) nor a "
                         "tool's name")
    return tuple(out)


def module_tools(module: str) -> list[dict[str, Any]]:
    """The JSON schemas of the tools ``module`` lists in ``tools`` (``data.tools``), as transformers describes a
    function; a module that does not load or a tool that cannot be described is a `DataError` naming the key."""
    try:
        return _module_schemas(module, os.getcwd())
    except SchemaError as e:
        raise DataError(f"data.tools={module!r}: {e}") from None


@functools.lru_cache(maxsize=8)
def _module_schemas(module: str, cwd: str) -> list[dict[str, Any]]:
    return module_schemas(module, cwd)


def _check_order(msgs: list[dict[str, Any]], ends_with: tuple[str, ...] = ("assistant",)) -> None:
    """An optional system turn, then user and assistant alternating from the user's, the last one of ``ends_with``;
    an assistant turn with tool calls is followed by their results (``tool`` turns), then the assistant again."""
    roles = [m["role"] for m in msgs]
    offset = 1 if roles and roles[0] == "system" else 0
    expected: tuple[str, ...] = ("user",)
    for k in range(offset, len(msgs)):
        role = roles[k]
        if role not in expected:
            said = " or ".join(repr(r) for r in expected)
            raise BadRow("role_order", f"turn {k} is {role!r} where {said} was expected (an optional system turn, "
                         "then user and assistant alternating; an assistant's tool calls followed by their tool "
                         "results)")
        if role == "assistant":
            expected = ("tool",) if msgs[k].get("tool_calls") else ("user",)
        else:
            expected = ("tool", "assistant") if role == "tool" else ("assistant",)
    if len(roles) == offset or roles[-1] not in ends_with:
        raise BadRow("role_order", f"the conversation does not end with {' or '.join(_A_TURN[r] for r in ends_with)} "
                     "turn")


_A_TURN = {"user": "a user", "assistant": "an assistant"}


def _preference(record: dict, fields: dict[str, str], data_cfg: DataConfig) -> Pair:
    """A row in one of TRL's preference forms (the module docstring) as a `Pair`."""
    chosen, rejected = (record.get(fields[k]) for k in ("chosen", "rejected"))
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise BadRow("missing_field", f"no {fields[key]!r} field (found {sorted(record)})"
                         + (f"; set data.fields.{key} to the field's name" if fields[key] == key else ""))
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = _string(record, fields["prompt"], "prompt")
        if not chosen.strip() or not rejected.strip():
            raise BadRow("empty_content", f"the {'chosen' if not chosen.strip() else 'rejected'} completion is empty")
        if chosen == rejected:
            raise BadRow("identical", "the chosen and the rejected completion are the same")
        return Pair(Example(prompt=prompt, completion=chosen), Example(prompt=prompt, completion=rejected),
                    margin=_margin(record))
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise BadRow("bad_type", f"{fields['chosen']!r} and {fields['rejected']!r} must both be strings (text) or "
                     f"both lists of messages, not {type(chosen).__name__} and {type(rejected).__name__}")
    roles = {r: r for r in ROLES}
    chosen_msgs = _turns(chosen, fields, roles, what=f"{fields['chosen']!r} message")
    rejected_msgs = _turns(rejected, fields, roles, what=f"{fields['rejected']!r} message")
    if chosen_msgs == rejected_msgs:
        raise BadRow("identical", "the chosen and the rejected completion are the same")
    if record.get(fields["prompt"]) is not None:
        prompt_msgs = _prompt_turns(record[fields["prompt"]], fields, roles,
                                    "a non-empty list of messages when the completions are")
    else:  # implicit prompt: the messages the two conversations share, up to a user turn
        shared = 0
        while (shared < min(len(chosen_msgs), len(rejected_msgs))
               and chosen_msgs[shared] == rejected_msgs[shared]):
            shared += 1
        if not shared or chosen_msgs[shared - 1]["role"] != "user":
            raise BadRow("prompt_mismatch", f"no {fields['prompt']!r} field, and the two conversations' shared "
                         f"start ({shared} messages) does not end with a user turn, so it is not a prompt; give "
                         "the prompt explicitly (data.fields.prompt names its field)")
        prompt_msgs = chosen_msgs[:shared]
        chosen_msgs, rejected_msgs = chosen_msgs[shared:], rejected_msgs[shared:]
    if not chosen_msgs or not rejected_msgs:
        raise BadRow("empty_content", f"the {'chosen' if not chosen_msgs else 'rejected'} completion has no message")
    for msgs in (chosen_msgs, rejected_msgs):
        _check_order([*prompt_msgs, *msgs])
    tools = row_tools(record, data_cfg)
    return Pair(Example(messages=tuple(prompt_msgs + chosen_msgs), tools=tools),
                Example(messages=tuple(prompt_msgs + rejected_msgs), tools=tools), len(prompt_msgs),
                _margin(record))


def _margin(record: dict) -> float | None:
    """A pair's ``margin`` (TRL's column, read by a reward model's loss), None without one."""
    margin = record.get("margin")
    if margin is None:
        return None
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise BadRow("bad_type", f"'margin' is {margin!r}; it must be a finite number (how much more the chosen "
                     "completion is preferred), or absent")
    return float(margin)


def _unpaired(record: dict, fields: dict[str, str], data_cfg: DataConfig) -> Labelled:
    """A row in TRL's unpaired preference forms (``prompt``, ``completion``, a boolean ``label``: text, or messages
    whose prompt ends with a user turn and whose completion is the assistant's) as a `Labelled`."""
    label = record.get(fields["label"])
    if label is None:
        raise BadRow("missing_field", f"no {fields['label']!r} field (found {sorted(record)})")
    if not isinstance(label, bool):
        raise BadRow("bad_type", f"{fields['label']!r} is {label!r}; it must be true (a desirable completion) or "
                     "false (an undesirable one)")
    completion = record.get(fields["completion"])
    if isinstance(completion, list):
        roles = {r: r for r in ROLES}
        prompt_msgs = _prompt_turns(record.get(fields["prompt"]), fields, roles,
                                    "a non-empty list of messages when the completion is")
        reply = _turns(completion, fields, roles, what=f"{fields['completion']!r} message")
        if not reply:
            raise BadRow("empty_content", "the completion has no message")
        _check_order([*prompt_msgs, *reply])
        return Labelled(Example(messages=tuple(prompt_msgs + reply), tools=row_tools(record, data_cfg)), label,
                        len(prompt_msgs))
    prompt = _string(record, fields["prompt"], "prompt")
    text = _string(record, fields["completion"], "completion")
    if not text.strip():
        raise BadRow("empty_content", "the completion is empty")
    return Labelled(Example(prompt=prompt, completion=text), label)


def _prompts(record: dict, fields: dict[str, str], data_cfg: DataConfig) -> Prompt:
    """A row in one of TRL's prompt forms (the module docstring) as a `Prompt`."""
    roles = {r: r for r in ROLES}
    kept = {k: v for k, v in record.items() if k not in (fields["prompt"], fields["messages"])}
    prompt = record.get(fields["prompt"])
    if prompt is None:
        if record.get(fields["messages"]) is None:
            raise BadRow("missing_field", f"no {fields['prompt']!r} or {fields['messages']!r} field (found "
                         f"{sorted(record)}); set data.fields.prompt (or data.fields.messages) to the field holding "
                         "the prompt")
        msgs = list(_conversation(record, fields, roles, "", ends_with=("user", "assistant")).messages)
        if msgs[-1]["role"] == "assistant":  # the reply the prompt had: its reference answer, not part of it
            kept["reference"] = msgs.pop()["content"]
        return Prompt(messages=tuple(msgs), fields=kept)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow("empty_content", "the prompt is empty")
        return Prompt(text=prompt, fields=kept)
    msgs = _prompt_turns(prompt, fields, roles, "a string (text) or a non-empty list of messages")
    _check_order(msgs, ends_with=("user",))
    return Prompt(messages=tuple(msgs), fields=kept)


def _prompt_turns(prompt: Any, fields: dict[str, str], roles: dict[str, str], expected: str) -> list[dict[str, str]]:
    """A prompt given as messages (``expected``: what the prompt field may hold, for the error): a non-empty list of
    turns, the last one the user's."""
    if not isinstance(prompt, list) or not prompt:
        raise BadRow("bad_type", f"{fields['prompt']!r} must be {expected} (it is "
                     f"{'an empty list' if prompt == [] else type(prompt).__name__})")
    msgs = _turns(prompt, fields, roles, what=f"{fields['prompt']!r} message")
    if msgs[-1]["role"] != "user":
        raise BadRow("role_order", f"the prompt's last turn is {msgs[-1]['role']!r}, not 'user' (the completions "
                     "answer a user turn)")
    return msgs


_CONVERSATION_REASONS = ("missing_field", "bad_type", "unknown_role", "role_order", "empty_content", "bad_tool_call",
                         "bad_tools")
_FIELD_REASONS = ("missing_field", "bad_type", "empty_content")
_PROMPT_REASONS = tuple(r for r in _CONVERSATION_REASONS if r != "bad_tools")  # a prompt's tools are the run's

FORMATS: dict[str, Format] = {}  # by name, in registration order


def register_format(fmt: Format) -> Format:
    """Make ``fmt`` readable as ``data.format: <its name>``; a batch kind's data module calls it for its formats."""
    if fmt.name in FORMATS:
        raise ValueError(f"row format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


# Detection tries these in this order (then the detect_last ones): the first whose detect_key a row holds is its.
for _format in (
    Format("messages", {"messages": "messages", "role": "role", "content": "content"}, "messages", _messages,
           _CONVERSATION_REASONS, noun="a chat conversation"),
    Format("sharegpt", {"messages": "conversations", "role": "from", "content": "value"}, "conversations", _sharegpt,
           _CONVERSATION_REASONS, noun="a ShareGPT conversation"),
    Format("alpaca", {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
           "instruction", _alpaca, _FIELD_REASONS, noun="an Alpaca instruction"),
    Format("preference", {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "role": "role",
                          "content": "content"}, "chosen", _preference, (*_CONVERSATION_REASONS, "identical",
                                                                          "prompt_mismatch"),
           noun="a preference pair {prompt, chosen, rejected}", keys=("chosen", "rejected")),
    # Before prompt_completion: its rows hold a completion too.
    Format("unpaired", {"prompt": "prompt", "completion": "completion", "label": "label", "role": "role",
                        "content": "content"}, "label", _unpaired, _CONVERSATION_REASONS,
           noun="an unpaired preference row {prompt, completion, label}"),
    Format("prompt_completion", {"prompt": "prompt", "completion": "completion"}, "completion", _prompt_completion,
           (*_FIELD_REASONS, "wrong_format"), chat=False, noun="a prompt/completion row"),
    # Last: a preference or a prompt/completion row holds a prompt too (a prompts row given as messages ending with
    # a user turn is detected as messages).
    Format("prompts", {"prompt": "prompt", "messages": "messages", "role": "role", "content": "content"}, "prompt",
           _prompts, _PROMPT_REASONS, detect_last=True, noun="a prompt alone {prompt, answer fields}",
           keys=("prompt", "messages")),
):
    register_format(_format)
# Why a row was bad (data.bad_rows): unreadable first, then each format's reasons, in this order in reports.
REASONS = tuple(dict.fromkeys([*READ_REASONS, *(r for f in FORMATS.values() for r in f.reasons), "wrong_format"]))


def field_names(data_cfg: DataConfig) -> dict[str, str]:
    """The field names of ``data.format``'s rows: its defaults with ``data.fields``' renames."""
    defaults = FORMATS[data_cfg.format].fields
    unknown = sorted(set(data_cfg.fields) - set(defaults))
    if unknown:
        raise DataError(f"data.fields.{unknown[0]} does not apply to data.format={data_cfg.format}; "
                        f"its fields are {sorted(defaults)}")
    return {**defaults, **data_cfg.fields}


def parse_row(record: Any, data_cfg: DataConfig, fields: dict[str, str]) -> Example | Pair | Prompt | Labelled:
    """A row as an `Example` (a `Pair`, a `Prompt`) of ``data.format``, or `BadRow` saying why it is not one;
    ``fields``: `field_names`."""
    if isinstance(record, BadRow):
        raise record
    if not isinstance(record, dict):
        raise BadRow("bad_type", f"a row must be a JSON object, not {type(record).__name__}")
    try:
        return FORMATS[data_cfg.format].parse(record, fields, data_cfg)
    except BadRow as bad:
        if bad.reason != "missing_field" or data_cfg.fields:
            raise
        other = other_format_hint(record, data_cfg.format)
        if other is None:
            raise
        raise BadRow("wrong_format", other) from None


def _objectives_of(fmt: str) -> list[str]:
    """The objectives that train on rows of ``fmt``."""
    return objectives_for(KIND_OF_FORMAT[fmt]) if fmt in KIND_OF_FORMAT else []


def _objectives_clause(names: list[str]) -> str:
    """", for objective.name=X" (X, Y or Z); empty for none."""
    return f", for objective.name={', '.join(names[:-1]) + ' or ' + names[-1] if len(names) > 1 else names[0]}" \
        if names else ""


def other_format_hint(record: dict, data_format: str) -> str | None:
    """Why a row that ``data.format`` cannot read is in the wrong shape, when it is a row of another format (or of
    TRL's unpaired preference form, which no objective here takes): what it looks like, what ``data.format`` reads,
    and which format and objective take it. None when it looks like no other format (a row broken on its own)."""
    wanted = f"data.format={data_format} reads {FORMATS[data_format].row_noun}"
    wanted += _objectives_clause(_objectives_of(data_format))
    fmt = next((f for f in sorted(FORMATS.values(), key=lambda f: f.detect_last)
                if f.name != data_format and f.detect_key in record), None)
    if fmt is None or FORMATS[data_format].own_keys & record.keys():  # like none, or this format's, a field lost
        return None
    takers = _objectives_of(fmt.name)
    pairs_for_unpaired = (KIND_OF_FORMAT.get(fmt.name), KIND_OF_FORMAT.get(data_format)) == (PAIRS, UNPAIRED)
    unpair = ("; or set data.unpair=true to read each pair as a desirable and an undesirable row (TRL's "
              "unpair_preference_dataset)") if pairs_for_unpaired else ""
    return (f"this row is {fmt.row_noun} (data.format={fmt.name}{_objectives_clause(takers)}), but {wanted}; give "
            f"rows of that shape, or train on these with data.format={fmt.name}"
            + (f" objective.name={takers[0]}" if takers else "") + unpair)


def iter_turn_texts(data_cfg: DataConfig,
                    rendered: Callable[[Example], list[str]] | None = None) -> Iterator[str]:
    """The text of every turn of every readable row: what a BPE tokenizer for this data learns from. A conversation
    with tools or tool calls gives ``rendered(example)`` instead, when given: the text the chat template makes of
    it (the tools' descriptions and the calls' markup are the template's, not in any turn's content)."""
    fields = field_names(data_cfg)
    for _, record in read_rows(data_cfg.sources, data_cfg):
        try:
            row = parse_row(record, data_cfg, fields)
        except BadRow:
            continue
        tooled = isinstance(row, Example) and (row.tools or any(m.get("tool_calls") for m in row.messages or ()))
        yield "\n".join(rendered(row) if rendered is not None and tooled else row.texts())


def detect_format(path: str) -> str:
    """The fine-tuning format a JSONL/JSON file's first row looks like (``text`` when it looks like none)."""
    for _, record in file_rows(Path(path).expanduser()):
        if isinstance(record, dict):
            for fmt in sorted(FORMATS.values(), key=lambda f: f.detect_last):  # stable: registration order
                if fmt.detect_key in record:
                    return fmt.name
        return "text"
    return "text"


def renders_chat(format_name: str) -> bool:
    """Whether rows of ``data.format`` are rendered by the chat template (prompts are then user turns too); for
    ``preference`` and ``prompts``, whose text rows go raw, whether their conversational rows would be."""
    return format_name in FORMATS and FORMATS[format_name].chat
