"""Chat templates as the model families ship them (trimmed to text-only), a conversation to render with them, and
the checkpoint-style tokenizers built for them: a tiny byte-level BPE trained offline on a few KB, saved with a
tokenizer_config.json that carries the template, loaded the way a checkpoint's tokenizer is."""

from __future__ import annotations

import json
from pathlib import Path

from jaxtune.config import DataConfig, TokenizerConfig
from jaxtune.data import load_tokenizer
from jaxtune.data.tokenizer import _train_bpe

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Gemma 3's template (text part): the system message is prepended to the first user turn; assistant is "model".
GEMMA = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
# ChatML with transformers' assistant-mask markers (as in SmolLM / TRL's assistant_only_loss templates).
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.3's template without the tool branches: no generation prompt, the reply is " content</s>".
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)

# name: (template, special tokens, eos, bos, end-of-turn token)
FAMILIES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|im_end|>"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], "<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>"),
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", "<bos>", "<end_of_turn>"),
    "generation": (CHATML_GENERATION, ["<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|im_end|>"),
}

SYSTEM = "You are a terse assistant. Réponds en français si besoin."
CONVO = (
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Write a Python function that squares x."},
    {"role": "assistant", "content": "```python\ndef square(x):\n    return x ** 2\n```"},
    {"role": "user", "content": "Now greet me in Japanese, with an emoji: naïve café."},
    {"role": "assistant", "content": "こんにちは 🙂 — naïve café, «déjà vu»."},
)
ASSISTANT = [m["content"] for m in CONVO if m["role"] == "assistant"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def square(x):\n    return x ** 2\n\nfor i in range(10):\n    print(square(i))\n",
    "Hello! How can I help you today? I am a helpful assistant and I answer questions briefly.\n",
    "naïve café — 日本語 🙂 こんにちは «déjà vu» Réponds en français si besoin.\n",
    "user assistant system model what is the answer question write a function that returns a value\n",
] * 6


def build_tokenizer(directory: Path, template: str | None, specials: list[str], eos: str, bos: str | None = None,
                    vocab_size: int = 400):
    """A checkpoint-style tokenizer directory (tokenizer.json + tokenizer_config.json), loaded as kind=hf."""
    directory.mkdir(parents=True, exist_ok=True)
    _train_bpe(iter(CORPUS), vocab_size, tuple(specials)).save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    if bos is not None:
        config["bos_token"] = bos
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(directory)), DataConfig())


def messages_cfg(**kw) -> DataConfig:
    """A DataConfig of ``kw``, by default of ``data.format: messages``."""
    kw.setdefault("format", "messages")
    return DataConfig(**kw)


def trl_template(name: str) -> str:
    """A chat template as its model family ships it, from the copies TRL 1.16 keeps to recognise models
    (``trl/chat_templates/NAME.jinja``: qwen2_5, qwen3, llama3_1 ...)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


# Mistral-7B-Instruct-v0.3's template with its tool branches: the tools listed before the last user turn, calls as a
# [TOOL_CALLS] JSON list whose ids must be 9 characters, results as [TOOL_RESULTS] objects naming their call.
MISTRAL_TOOLS = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional " ~
                            "system message!") }}
    {%- endif %}
{%- endfor %}
"""
