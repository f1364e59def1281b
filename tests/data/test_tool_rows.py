"""Tool-calling conversations in SFT and DPO rows (TRL's and transformers' form: assistant ``tool_calls``, ``tool``
turns, a ``tools`` column): rendered by the model's chat template token for token as transformers'
``apply_chat_template(tools=...)`` renders them, the loss on the assistant's calls and text and never on the tools'
results, and a malformed call or a template that drops calls refused naming the row."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from helpers.chat_templates import MISTRAL_TOOLS, build_tokenizer, messages_cfg, trl_template
from helpers.rows import write_jsonl

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.formats import Example, field_names, parse_row
from jaxtune.data.preference import encode_pairs
from jaxtune.data.sft import Encoder, load_examples
from jaxtune.data.templates import CHATML_TOOLS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "the unit"}},
        "required": ["city"]}}}
PARIS = {"city": "Paris", "unit": "celsius"}
TOKYO = {"city": "Tokyo"}


def _call(arguments, id_: str) -> dict:
    # arguments as a JSON string, as OpenAI's API and many data sets give them: parsed to a dict when read
    return {"id": id_, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}


# Text beside two calls, their two results, the answer; then a second question answered without a tool.
TWO_CALLS = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "You answer about the weather."},
    {"role": "user", "content": "Is it warmer in Paris or in Tokyo?"},
    {"role": "assistant", "content": "Let me look at both cities.",
     "tool_calls": [_call(PARIS, "call0par1"), _call(TOKYO, "call0tok2")]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "call0par1", "content": "18 degrees, cloudy"},
    {"role": "tool", "name": "get_weather", "tool_call_id": "call0tok2", "content": "24 degrees, sunny"},
    {"role": "assistant", "content": "Tokyo is warmer: 24 against 18 degrees."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."}]}
# One call with no text beside it (content null, as OpenAI writes it): Llama 3.1's template takes one call a turn.
ONE_CALL = {"tools": json.dumps([WEATHER]), "messages": [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call(PARIS, "call0par1")]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "call0par1", "content": "18 degrees, cloudy"},
    {"role": "assistant", "content": "It is 18 degrees and cloudy in Paris."}]}
RESULTS = ("18 degrees, cloudy", "24 degrees, sunny")

QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# name: (template, special tokens, eos, bos, rows it renders)
TEMPLATES = {
    "chatml-tools": (CHATML_TOOLS, QWEN, "<|im_end|>", None, (TWO_CALLS, ONE_CALL)),
    "qwen2.5": (trl_template("qwen2_5"), QWEN, "<|im_end|>", None, (TWO_CALLS, ONE_CALL)),
    "qwen3": (trl_template("qwen3"), QWEN, "<|im_end|>", None, (TWO_CALLS, ONE_CALL)),
    "llama3.1": (trl_template("llama3_1"), LLAMA, "<|eot_id|>", "<|begin_of_text|>", (ONE_CALL,)),
    "mistral-v0.3": (MISTRAL_TOOLS, MISTRAL, "</s>", "<s>", (TWO_CALLS, ONE_CALL)),
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """name -> (jaxtune's tokenizer, transformers' AutoTokenizer) of the same checkpoint-style directory."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tool-tokenizers")
    out = {}
    for name, (template, specials, eos, bos, _) in TEMPLATES.items():
        ours = build_tokenizer(root / name, template, specials, eos, bos)
        out[name] = (ours, AutoTokenizer.from_pretrained(str(root / name)))
    return out


def _read(row: dict, **cfg) -> Example:
    data_cfg = messages_cfg(**cfg)
    return parse_row(row, data_cfg, field_names(data_cfg))


def _runs(ids: np.ndarray, mask: np.ndarray, tok) -> list[str]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("name", TEMPLATES)
def test_tool_rows_are_transformers_tokens(toks, name):
    """The ids equal transformers' apply_chat_template(messages, tools=...) on the same messages (arguments as
    dicts); the trained runs are the assistant's turns (text, calls and end-of-turn) and hold no tool result."""
    ours, hf = toks[name]
    eot = TEMPLATES[name][2]
    for row in TEMPLATES[name][4]:
        ex = _read(row)
        assert [c["function"]["arguments"] for m in ex.messages for c in m.get("tool_calls", ())] == \
            [json.loads(c["function"]["arguments"]) for m in row["messages"] for c in m.get("tool_calls") or ()]
        (enc,) = Encoder(ours, messages_cfg()).encode([ex])
        expected = hf.apply_chat_template([dict(m) for m in ex.messages], tools=[WEATHER], tokenize=True,
                                          return_dict=False)
        assert enc.ids.tolist() == list(expected), name
        runs = _runs(enc.ids, enc.mask, ours)
        replies = [m for m in ex.messages if m["role"] == "assistant"]
        assert len(runs) == len(replies), (name, runs)
        for run, reply in zip(runs, replies):
            assert run.rstrip().endswith(eot), (name, run)
            for call in reply.get("tool_calls", ()):
                assert call["function"]["name"] in run and call["function"]["arguments"]["city"] in run, run
            if not reply.get("tool_calls") or name != "mistral-v0.3":  # v0.3 renders no text beside its calls
                assert reply["content"].strip() in run, (name, run)
        assert not any(result in run for result in RESULTS for run in runs), (name, runs)


def test_text_beside_a_call_is_kept_and_trained(toks):
    """The issue's case: a call with text beside it kept both (the call was dropped before), empty content taken."""
    ours, _ = toks["chatml-tools"]
    (enc,) = Encoder(ours, messages_cfg()).encode([_read(TWO_CALLS)])
    first = _runs(enc.ids, enc.mask, ours)[0]
    assert first == ('Let me look at both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                     '"Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                     '{"city": "Tokyo"}}\n</tool_call><|im_end|>')


def test_a_template_that_drops_calls_is_refused_naming_the_row(tmp_path, toks):
    from helpers.chat_templates import CHATML

    tok = build_tokenizer(tmp_path / "chatml", CHATML, QWEN, "<|im_end|>")
    path = write_jsonl(tmp_path / "calls.jsonl", [ONE_CALL])
    cfg = messages_cfg(sources=[str(path)])
    with pytest.raises(DataError, match=r"calls\.jsonl:1: the chat template does not render the tool call of "
                                        r"'get_weather' of turn 1.*data\.chat_template: chatml-tools"):
        load_examples([str(path)], cfg, tok, __import__("jaxtune.data.sft", fromlist=["SFTStats"]).SFTStats())


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments='{"city": "Paris",'),
     "turn 1 tool call 0 (get_weather): its arguments are not valid JSON"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].pop("name"), "turn 1 tool call 0 has no function name"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="[1, 2]"),
     "its arguments are list; they must be an object"),
    (lambda r: r["messages"].pop(2), "turn 2 is 'assistant' where 'tool' was expected"),
    (lambda r: r["messages"].insert(1, {"role": "tool", "content": "x"}), "turn 1 is 'tool' where 'assistant'"),
    (lambda r: r.update(tools=["get_weather"]), "tools[0] names the tool 'get_weather': set data.tools"),
    (lambda r: r.update(tools="[{"), "'tools' is a string but not JSON"),
])
def test_malformed_tool_rows_are_one_line_naming_the_row(tmp_path, change, message):
    row = json.loads(json.dumps(ONE_CALL))
    change(row)
    path = write_jsonl(tmp_path / "bad.jsonl", [ONE_CALL, row])
    from jaxtune.data.row_policy import parsed_rows
    from jaxtune.data.sft import SFTStats

    cfg = messages_cfg(sources=[str(path)])
    with pytest.raises(DataError) as e:
        list(parsed_rows([str(path)], cfg, SFTStats(), 16))
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value) and "\n" not in str(e.value), e.value


def test_tools_by_name_from_a_module_and_by_default(tmp_path, monkeypatch):
    """A ``tools`` column of names is read against data.tools's module, as is every row without the column; both
    give the schemas transformers' get_json_schema makes of the functions."""
    from transformers.utils import get_json_schema

    from jaxtune import recipe_tools

    row = {"messages": [{"role": "user", "content": "7 times 6?"},
                        {"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": "multiply",
                                                                          "arguments": {"a": 7, "b": 6}}}]},
                        {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42."}]}
    expected = (get_json_schema(recipe_tools.multiply),)
    assert _read({**row, "tools": ["multiply"]}, tools="jaxtune.recipe_tools").tools == expected
    assert _read(row, tools="jaxtune.recipe_tools").tools == expected
    assert _read(row).tools == ()
    for given in ("my_tools.py", "./my_tools.py"):  # the words objective.tools says too (test_agent_errors.py)
        with pytest.raises(DataError, match=rf"data.tools='{re.escape(given)}': name the module, not its file: "
                                            r"data.tools=my_tools \(it is imported"):
            _read(row, tools=given)
    (tmp_path / "weather_tools.py").write_text("def f(x):\n    return x\n\ntools = [f]\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"data.tools='weather_tools': tool 'f' has no docstring"):
        _read(row, tools="weather_tools")


def test_the_agent_fine_tune_rows_are_tool_calls():
    """synthetic:multiply-hasty (the agent-sft quickstart's data) is in this form and renders as it did when its calls
    were written into the text by hand (the rollout's prompt and the tool's result as the run renders them)."""
    import itertools

    from jaxtune.data.synthetic import multiply_hasty

    row = next(r for r in itertools.islice(multiply_hasty(), 50) if len(r["messages"]) == 4)
    ex = _read(row, tools="jaxtune.recipe_tools")
    _, call, result, _ = ex.messages
    assert call["tool_calls"][0]["function"]["name"] == "multiply" and result["role"] == "tool"


def test_dpo_pairs_with_tool_calls(toks):
    """A preference pair whose completions call a tool (or do not): the prompt with the tools is shared, each
    completion's call trained, the result of the chosen one's call not."""
    ours, hf = toks["qwen2.5"]
    prompt = [{"role": "user", "content": "What is the weather in Paris?"}]
    chosen = [{"role": "assistant", "content": "", "tool_calls": [_call(PARIS, "call0par1")]},
              {"role": "tool", "content": RESULTS[0]}, {"role": "assistant", "content": "18 degrees."}]
    rejected = [{"role": "assistant", "content": "It is always sunny in Paris."}]
    cfg = DataConfig(format="preference")
    pair = parse_row({"prompt": prompt, "chosen": chosen, "rejected": rejected, "tools": [WEATHER]}, cfg,
                     field_names(cfg))
    (good, bad), = encode_pairs(Encoder(ours, cfg), [pair])
    for enc, ex in ((good, pair.chosen), (bad, pair.rejected)):
        assert enc.ids.tolist() == list(hf.apply_chat_template([dict(m) for m in ex.messages], tools=[WEATHER],
                                                               tokenize=True, return_dict=False))
        assert "get_weather" in ours.decode(enc.ids[:int(np.argmax(enc.mask))].tolist())  # the tools, in the prompt
    runs = _runs(good.ids, good.mask, ours)
    assert len(runs) == 2 and "get_weather" in runs[0] and RESULTS[0] not in "".join(runs)
