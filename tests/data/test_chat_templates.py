"""The assistant mask under chat templates that do not render a conversation's beginning as the beginning of its
text (jaxtune.data.sft, "Loss mask without template markers"): Qwen 3, Mistral with a system message.

The templates are the real ones, written out here since hubs are unreachable from the tests; the tokenizers are
`helpers.chat_templates`' tiny BPE with each template's special tokens. Every check decodes each trained run of
tokens on its own and compares it with the reply as the template renders it plus the end-of-turn.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.chat_templates import CONVO, FAMILIES, MISTRAL, SYSTEM, build_tokenizer, messages_cfg

from jaxtune.config import DataConfig, TokenizerConfig
from jaxtune.data import load_tokenizer
from jaxtune.data.formats import Example
from jaxtune.data.sft import Encoder

# Qwen3-8B's tokenizer_config.json chat_template (the hybrid-thinking Qwen 3 models), verbatim: reasoning is dropped
# from replies before the last user query, and replies after it open with a <think> block, empty or not.
QWEN3 = (r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with """
r"""function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within """
r"""<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": """
r"""<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and """
r"""not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = """
r"""content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' """
r"""+ content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}""")

# Mistral-Small-24B-Instruct-2501's template (Mistral's v7 format), verbatim: the system prompt opens the text.
MISTRAL_V7 = (r"""{%- set today = strftime_now("%Y-%m-%d") %}
{%- set default_system_message = "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a """
r"""French startup headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. The current date is """
r"""" + today + ".\n\nWhen you're not sure about some information, you say that you don't have the information and """
r"""don't make up anything.\nIf the user's question is not clear, ambiguous, or does not provide enough context for """
r"""you to accurately answer the question, you do not try to answer it right away and you rather ask the user to """
r"""clarify their request (e.g. \"What are some good restaurants around me?\" => \"Where are you?\" or \"When is the """
r"""next flight to Tokyo\" => \"Where do you travel from?\")" %}

{{- bos_token }}

{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = default_system_message %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}

{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user, system and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}""")

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]
MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]"]
# name: (template, special tokens, eos, bos, end-of-turn)
TEMPLATES = {
    **FAMILIES,
    "qwen3": (QWEN3, ["<|endoftext|>", *CHATML_SPECIALS, "<think>", "</think>"], "<|im_end|>", None, "<|im_end|>"),
    "mistral_v7": (MISTRAL_V7, [*MISTRAL_SPECIALS, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], "</s>", "<s>", "</s>"),
    "mistral_v03": (MISTRAL, MISTRAL_SPECIALS, "</s>", "<s>", "</s>"),
}
A0, A1 = (m["content"] for m in CONVO if m["role"] == "assistant")
THREE_TURNS = (*CONVO, {"role": "user", "content": "And once more, shorter?"},
               {"role": "assistant", "content": "Hi 🙂"})


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """name -> tokenizer of TEMPLATES, built once per module."""
    root = tmp_path_factory.mktemp("tokenizers")
    for name, (template, specials, eos, bos, _) in TEMPLATES.items():
        build_tokenizer(root / name, template, specials, eos, bos)
    return {name: load_tokenizer(TokenizerConfig(kind="hf", path=str(root / name)), DataConfig()) for name in TEMPLATES}


def trained_runs(tok, messages, data_cfg=None, prompt_turns=0) -> list[str]:
    """Each contiguous run of trained tokens, decoded on its own; checks the ids decode to the whole rendering."""
    (enc,) = Encoder(tok, data_cfg or messages_cfg()).encode([Example(messages=tuple(messages))], [prompt_turns])
    assert tok.decode(enc.ids.tolist()) == tok.apply_chat_template([dict(m) for m in messages])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], enc.mask.astype(np.int8), [0]])))
    return [tok.decode(enc.ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


def fast_path_refuses(tok, messages) -> bool:
    msgs = [dict(m) for m in messages]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    return Encoder(tok, messages_cfg()).prefix_spans(msgs, tok.apply_chat_template(msgs), turns) is None


# --- Qwen 3 ---


def test_qwen3_multi_turn(toks):
    """Replies before the last user message: content + <|im_end|>; the last: its <think> block too, even empty."""
    tok = toks["qwen3"]
    assert fast_path_refuses(tok, CONVO)  # the template gives the last reply a <think> block, earlier ones not
    assert trained_runs(tok, CONVO) == [A0 + "<|im_end|>", f"<think>\n\n</think>\n\n{A1}<|im_end|>"]
    assert trained_runs(tok, THREE_TURNS) == [A0 + "<|im_end|>", A1 + "<|im_end|>",
                                              "<think>\n\n</think>\n\nHi 🙂<|im_end|>"]
    # The prompt before the first reply is exactly what inference feeds the model.
    (enc,) = Encoder(tok, messages_cfg()).encode([Example(messages=CONVO)])
    prompt = tok.apply_chat_template([dict(m) for m in CONVO[:2]], add_generation_prompt=True)
    assert enc.ids[:int(np.argmax(enc.mask))].tolist() == tok.encode_chat([prompt])[0]
    assert SYSTEM in tok.decode(enc.ids[~enc.mask].tolist())
    # One exchange is prefix-stable: the fast way, with the same rule for the <think> block.
    assert not fast_path_refuses(tok, CONVO[:3])
    assert trained_runs(tok, CONVO[:3]) == [f"<think>\n\n</think>\n\n{A0}<|im_end|>"]


def test_qwen3_reasoning(toks):
    """Reasoning, as reasoning_content or as <think>...</think> in the content: dropped by the template from earlier
    replies (so not trained), trained inside the last reply's <think> block."""
    tok = toks["qwen3"]
    as_field = [dict(m) for m in CONVO]
    as_field[2]["reasoning_content"] = "Square means x times x."
    as_field[4]["reasoning_content"] = "\nJapanese greeting: konnichiwa.\n"
    in_content = [dict(m) for m in CONVO]
    in_content[2]["content"] = f"<think>\nSquare means x times x.\n</think>\n\n{A0}"
    in_content[4]["content"] = f"<think>Japanese greeting: konnichiwa.</think>{A1}"
    expected = [A0 + "<|im_end|>", f"<think>\nJapanese greeting: konnichiwa.\n</think>\n\n{A1}<|im_end|>"]
    assert trained_runs(tok, as_field) == expected
    assert trained_runs(tok, in_content) == expected
    assert "Square means" not in tok.apply_chat_template(in_content)


def test_qwen3_last_assistant_and_preference_prompt(toks):
    tok = toks["qwen3"]
    last = "<think>\n\n</think>\n\nHi 🙂<|im_end|>"
    assert trained_runs(tok, THREE_TURNS, messages_cfg(loss_on="last_assistant")) == [last]
    # A preference pair's prompt (its first 5 messages here) is not trained, however the template renders it.
    assert trained_runs(tok, THREE_TURNS, prompt_turns=5) == [last]
    assert trained_runs(tok, THREE_TURNS, prompt_turns=3) == [A1 + "<|im_end|>", last]


def test_qwen3_thinking_disabled_in_the_template(toks):
    """enable_thinking false puts the empty <think> block in the generation prompt: it is prompt, not trained."""
    tok = toks["qwen3"]
    tok.chat_template = "{%- set enable_thinking = false %}" + QWEN3
    try:
        prompt = tok.apply_chat_template([dict(m) for m in CONVO[:4]], add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert trained_runs(tok, CONVO) == [A0 + "<|im_end|>", A1 + "<|im_end|>"]
    finally:
        tok.chat_template = QWEN3


# --- Mistral with a system message ---


def test_mistral_v7_with_system(toks):
    """v7 opens the text with the system prompt, so it is prefix-stable: the fast way; the reply has no leading
    space ([/INST] ends the prompt)."""
    tok = toks["mistral_v7"]
    text = tok.apply_chat_template(list(CONVO))
    assert text == (f"<s>[SYSTEM_PROMPT]{SYSTEM}[/SYSTEM_PROMPT][INST]{CONVO[1]['content']}[/INST]{A0}</s>"
                    f"[INST]{CONVO[3]['content']}[/INST]{A1}</s>")
    assert not fast_path_refuses(tok, CONVO)
    assert trained_runs(tok, CONVO) == [A0 + "</s>", A1 + "</s>"]
    assert trained_runs(tok, THREE_TURNS) == [A0 + "</s>", A1 + "</s>", "Hi 🙂</s>"]
    # Without a system message it writes its default one, dated: still located.
    assert trained_runs(tok, CONVO[1:]) == [A0 + "</s>", A1 + "</s>"]


def test_mistral_v03_with_system(toks):
    """v0.3 (and Nemo) put the system message into the last user turn, so the prompt of an earlier reply is not the
    beginning of the text: the reply is located, its leading space included as without a system message."""
    tok = toks["mistral_v03"]
    assert fast_path_refuses(tok, CONVO)
    assert trained_runs(tok, CONVO) == [f" {A0}</s>", f" {A1}</s>"]
    assert trained_runs(tok, THREE_TURNS) == [f" {A0}</s>", f" {A1}</s>", " Hi 🙂</s>"]
    assert trained_runs(tok, CONVO[1:]) == [f" {A0}</s>", f" {A1}</s>"]  # no system: the fast way, the same runs


# --- every template: both ways agree where both apply ---


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_located_spans_match_the_fast_way(toks, name):
    """Where the fast way applies, locating the replies finds the very same spans, for every template."""
    tok = toks[name]
    enc = Encoder(tok, messages_cfg())
    checked = 0
    for messages in (CONVO, CONVO[1:], CONVO[:3], THREE_TURNS, THREE_TURNS[1:]):
        msgs = [dict(m) for m in messages]
        full = tok.apply_chat_template(msgs)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for chosen in (turns, turns[-1:], turns[1:]):
            fast = enc.prefix_spans(msgs, full, chosen)
            if fast is not None:
                assert enc.located_spans(msgs, full, chosen) == fast
                checked += 1
    assert checked >= 6  # even Qwen 3 and Mistral v0.3 are prefix-stable on some of these


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_span_is_the_reply_and_its_end_of_turn(toks, name):
    """Each trained run decodes to the reply as the template renders it plus the end-of-turn, every template."""
    template, _, _, _, eot = TEMPLATES[name]
    tok = toks[name]
    assert tok.chat_template == template
    lead = " " if name == "mistral_v03" else ""  # its replies are rendered after a space
    replies = [m["content"] for m in THREE_TURNS if m["role"] == "assistant"]
    if name == "qwen3":
        replies[-1] = "<think>\n\n</think>\n\n" + replies[-1]
    assert trained_runs(tok, THREE_TURNS) == [lead + r + eot for r in replies]
