"""The chat templates jaxtune ships (``data.chat_template: chatml``, ``gemma``, ``chatml-tools``) and what a
``data.chat_template`` value names (`template_text`), with no tokenizer: the tokenizer a run trains learns from
conversations rendered by it (`jaxtune.data.tokenizer`), and `jaxtune.data.chat` sets it on the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from jaxtune.data.errors import DataError

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# Gemma's turn format, for a Gemma base checkpoint (its GGUF carries no template): the system message opens the
# first user turn, the assistant is "model", contents are trimmed; the same text as the instruction-tuned
# checkpoints' own template renders.
GEMMA = ("{{ bos_token }}"
         "{%- set system = messages and messages[0]['role'] == 'system' -%}"
         "{%- set head = messages[0]['content'] ~ '\\n\\n' if system else '' -%}"
         "{%- for m in (messages[1:] if system else messages) -%}"
         "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\\n'"
         " ~ (head if loop.first else '') ~ (m['content'] | trim) ~ '<end_of_turn>\\n' }}"
         "{%- endfor -%}"
         "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")
# ChatML with tools: the tools listed in the system turn one per line (name, typed parameters, description: short, so
# a small model's context holds them), an assistant's calls as Hermes-style <tool_call> blocks of JSON (Qwen 2.5/3's),
# and consecutive tool results as <tool_response> blocks of one user turn.
CHATML_TOOLS = (
    "{%- set system = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}{% if system %}{{ messages[0]['content'] ~ '\\n\\n' }}{% endif %}"
    "{{ 'Tools:' }}"
    "{%- for tool in tools %}{% set f = tool['function'] if tool.get('function') else tool %}"
    "{{ '\\n- ' ~ f['name'] ~ '(' }}"
    "{%- for name, p in (f.get('parameters') or {}).get('properties', {}).items() -%}"
    "{{ name ~ ': ' ~ p.get('type', 'any') }}{% if not loop.last %}{{ ', ' }}{% endif %}"
    "{%- endfor %}{{ '): ' ~ f.get('description', '') }}{% endfor %}"
    "{{ '\\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>.<|im_end|>\\n' }}"
    "{%- elif system -%}{{ '<|im_start|>system\\n' ~ messages[0]['content'] ~ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
    "{{ '\\n<tool_response>\\n' ~ m['content'] ~ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- elif not (loop.first and system) -%}"
    "{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ (m['content'] or '') }}"
    "{%- for call in m.get('tool_calls') or [] -%}"
    "{%- set f = call['function'] if call.get('function') else call -%}"
    "{%- if m['content'] or not loop.first %}{{ '\\n' }}{% endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' ~ f['name'] ~ '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}")
SHIPPED_TEMPLATES = {"chatml": CHATML, "gemma": GEMMA, "chatml-tools": CHATML_TOOLS}


def template_text(spec: str | None) -> str | None:
    """The template ``data.chat_template`` names: a shipped name, a .jinja file or template text (None: none set,
    the tokenizer's own is used)."""
    if spec is None:
        return None
    if spec in SHIPPED_TEMPLATES:
        return SHIPPED_TEMPLATES[spec]
    if spec.endswith(".jinja") and "{" not in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DataError(f"data.chat_template: no such file {spec}")
        return path.read_text()
    if "{%" in spec or "{{" in spec:
        return spec
    raise DataError(f"data.chat_template={spec!r}: not a shipped template ({sorted(SHIPPED_TEMPLATES)}), a .jinja "
                    "file or template text")
