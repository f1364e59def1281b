"""Chat templates: which one a run uses, and prompts, stops and samples as a chat model sees them.

A tokenizer brings its own Jinja chat template (transformers' convention; rendered by
`Tokenizer.apply_chat_template`); ``data.chat_template`` replaces it with a shipped one (``chatml``, ``gemma``), a
.jinja file or template text. Training renders conversations with it (`jaxtune.data.sft`); generation renders a
prompt as one user turn with the assistant's generation prompt (`encode_prompt`) and stops at EOS or the template's
end-of-turn token (`stop_ids`).
"""

from __future__ import annotations

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.formats import FORMATS
from jaxtune.data.templates import template_text
from jaxtune.data.tokenizer import Tokenizer


def resolve_chat_template(data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """Sets ``tokenizer.chat_template`` from ``data.chat_template`` (a shipped name, a .jinja file or template
    text); without it the tokenizer's own template is used, and is required for the chat formats."""
    text = template_text(data_cfg.chat_template)
    if text is not None:
        tokenizer.chat_template = text
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
