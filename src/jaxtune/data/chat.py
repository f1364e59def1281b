"""Chat templates: which one a run uses, and prompts, stops and samples as a chat model sees them.

A tokenizer brings its own Jinja chat template (transformers' convention; rendered by
`Tokenizer.apply_chat_template`); ``data.chat_template`` replaces it with a shipped one (``chatml``, ``gemma``), a
.jinja file or template text. Training renders conversations with it (`jaxtune.data.sft`); generation renders a
prompt as one user turn with the assistant's generation prompt (`encode_prompt`) and stops at EOS or the template's
end-of-turn token (`stop_ids`).
"""

from __future__ import annotations

from pathlib import Path

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.formats import FORMATS
from jaxtune.data.tokenizer import Tokenizer

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


def resolve_chat_template(data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """Sets ``tokenizer.chat_template`` from ``data.chat_template`` (a shipped name, a .jinja file or template
    text); without it the tokenizer's own template is used, and is required for the chat formats."""
    spec = data_cfg.chat_template
    if spec is not None:
        if spec in SHIPPED_TEMPLATES:
            tokenizer.chat_template = SHIPPED_TEMPLATES[spec]
        elif spec.endswith(".jinja") and "{" not in spec:
            path = Path(spec).expanduser()
            if not path.is_file():
                raise DataError(f"data.chat_template: no such file {spec}")
            tokenizer.chat_template = path.read_text()
        elif "{%" in spec or "{{" in spec:
            tokenizer.chat_template = spec
        else:
            raise DataError(f"data.chat_template={spec!r}: not a shipped template ({sorted(SHIPPED_TEMPLATES)}), a "
                            ".jinja file or template text")
    if FORMATS[data_cfg.format].chat and tokenizer.chat_template is None:
        raise DataError(f"data.format={data_cfg.format} needs a chat template and the tokenizer has none; set "
                        "data.chat_template (chatml, gemma, a .jinja file, or template text)")


# A reply no template mangles (no surrounding whitespace, no markup) and no conversation contains: rendered in an
# assistant turn's place, it shows where the template puts that turn's content and what follows it.
REPLY_PLACEHOLDER = "JAXTUNE-REPLY-PLACEHOLDER-5e1d"


def end_of_turn(tokenizer: Tokenizer) -> str:
    """The text the chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``, ``</s>``): what
    follows the reply in a one-exchange conversation, without trailing whitespace; "" when the template renders no
    reply content."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"},
                                          {"role": "assistant", "content": REPLY_PLACEHOLDER}])
    at = text.find(REPLY_PLACEHOLDER)
    return text[at + len(REPLY_PLACEHOLDER):].rstrip() if at >= 0 else ""


def end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    """Token ids that end an assistant turn under the chat template (besides EOS): generation stops at them."""
    try:
        tail = end_of_turn(tokenizer)
    except DataError:
        return []
    ids = tokenizer.encode_chat([tail])[0] if tail else []
    return ids[:1] if len(ids) == 1 else []


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool = False) -> list[int]:
    """Prompt ids: the text after the tokenizer's BOS (if its checkpoint adds one), or (``chat``) as one user turn
    rendered by the chat template (which writes its own BOS) with the assistant's generation prompt."""
    if not chat:
        return [*tokenizer.bos_prefix, *tokenizer.encode(text)]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode_chat([rendered])[0]


def stop_ids(tokenizer: Tokenizer, chat: bool = False) -> list[int]:
    """EOS, and for chat the template's end-of-turn token (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``)."""
    return [tokenizer.eos_id, *(end_of_turn_ids(tokenizer) if chat else [])]


def format_sample(prompt: str, completion: str, chat: bool) -> str:
    """A prompt and the model's completion as one readable text: for chat, as a user/assistant exchange."""
    return (f"user: {prompt}\nassistant: " if chat else prompt) + completion
