"""Prompts (``data.format: prompts``, TRL's GRPO conventions): rows → `Prompt`s → prompt ids → one prompt per item,
right-padded to ``max_prompt_tokens``, for objectives that generate their completions (``grpo``).

**Rows.** Read and understood as SFT rows are (`jaxtune.data.formats`: the three forms, the bad-row reasons, which
``data.bad_rows`` raises with file:line or counts). Every field of a row besides its prompt (``answer``...) is kept for
the reward functions, with ``reference`` the reply that ended a ``messages`` conversation.

**Encoding.** A text prompt is encoded as is (no chat template, no special token added). A conversational one is
rendered by the chat template (``data.chat_template`` or the tokenizer's) with the generation prompt: exactly the ids
an assistant reply follows, as at inference (`jaxtune.data.sft.question`). Text prompts need no chat template; a
conversational prompt without one is an error that says to set ``data.chat_template``.

**Length.** A prompt holds at most ``max_prompt_tokens``: the sequence less the room its completion takes
(``data.seq_len - objective.max_completion_length``, which the training loop passes). A longer one is truncated,
dropped or raises (``data.overlong``); truncation keeps its last tokens (TRL's left truncation: the end of the prompt,
which the reply follows, survives). A prompt over ``data.max_prompt_length`` tokens keeps its last ones first
(counted, whatever ``data.overlong`` says); the training loop's limit is then at most that.

**Items.** `PromptRows` item ``i`` is prompt ``i``'s ids right-padded with 0, its length, and ``i`` itself, by which
the host finds the row's fields (`PromptRows.fields`) for the rewards when a batch comes back.

**Held out.** ``data.val_fraction`` of the prompts, by a hash of their tokens (identical prompts share a split), or
``data.val_sources``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.data.encoded import Encoded, Examples
from jaxtune.data.formats import Prompt
from jaxtune.data.row_policy import RowStats, completion_settings, overlong_error, parsed_rows, split_rows
from jaxtune.data.tokenizer import Tokenizer

# What sets a prompt's length limit, and how else to make room, as data.overlong=raise says.
_LIMIT = "data.seq_len - objective.max_completion_length"
_REMEDY = "raise data.seq_len or lower objective.max_completion_length"


@dataclass
class EncodedPrompt:
    where: str  # the row's file:line
    prompt: Prompt
    ids: np.ndarray  # int32 (n,), n <= max_prompt_tokens


class PromptRows:
    """Grain random-access source: item ``i`` is {"prompt": int32 (max_prompt_tokens,), prompt ``i``'s ids
    right-padded with 0; "prompt_len": int32 (); "row": int32 () = i}. On the host, `ids`, `fields`, `prompt` and
    `where` give row ``i``'s ids, other fields, prompt as given and file:line."""

    def __init__(self, rows: list[EncodedPrompt], max_prompt_tokens: int):
        self.max_prompt_tokens = max_prompt_tokens
        # The ids concatenated, as SFT keeps its rows (a prompt trains no token: the mask is all False).
        self.examples = Examples.of([Encoded(r.ids, np.zeros(len(r.ids), bool)) for r in rows])
        self._prompts = [r.prompt for r in rows]
        self._where = [r.where for r in rows]

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        ids, _ = self.examples.row(i)
        prompt = np.zeros(self.max_prompt_tokens, np.int32)
        prompt[:len(ids)] = ids
        return {"prompt": prompt, "prompt_len": np.asarray(len(ids), np.int32), "row": np.asarray(i, np.int32)}

    def ids(self, i: int) -> list[int]:
        """Prompt ``i``'s ids, unpadded."""
        return self.examples.row(i)[0].tolist()

    def fields(self, i: int) -> dict[str, Any]:
        """Row ``i``'s fields besides its prompt (a copy: a reward function may change it), with ``reference`` the
        reply that ended its ``messages`` conversation, if one did."""
        return copy.deepcopy(self._prompts[i].fields)

    def prompt(self, i: int) -> str | list[dict[str, str]]:
        """Row ``i``'s prompt as a reward function receives it (TRL's): the text, or the messages (``role`` and
        ``content``, whatever ``data.fields`` renamed) without a reply that ended a ``messages`` conversation."""
        p = self._prompts[i]
        return [dict(m) for m in p.messages] if p.messages else p.text

    def where(self, i: int) -> str:
        """Row ``i``'s place in the sources (file:line), for errors about it."""
        return self._where[i]


@dataclass
class PromptStats(RowStats):
    train_prompts: int = 0
    val_prompts: int = 0
    max_prompt_tokens: int = 0
    longest: int = 0  # tokens of the longest training prompt (after truncation)

    def lines(self) -> list[str]:
        return [(f"prompt data: {self.rows} rows -> {self.train_prompts} training and {self.val_prompts} held-out "
                 f"prompts; the longest {self.longest} tokens of at most {self.max_prompt_tokens}"),
                *self.drop_lines("prompts")]


@dataclass
class PromptData:
    train: PromptRows
    val: PromptRows | None
    stats: PromptStats
    max_prompt_tokens: int


def encode_prompts(tokenizer: Tokenizer, prompts: list[Prompt]) -> list[np.ndarray]:
    """Each prompt's ids, int32 (n,): text encoded as is, messages rendered by the chat template with the generation
    prompt; text and conversational prompts may mix."""
    out: list[np.ndarray] = [np.zeros(0, np.int32)] * len(prompts)
    for chat in (False, True):
        picked = [i for i, p in enumerate(prompts) if bool(p.messages) == chat]
        if not picked:
            continue
        if chat:
            encoded = tokenizer.encode_chat([
                tokenizer.apply_chat_template([dict(m) for m in prompts[i].messages], add_generation_prompt=True)
                for i in picked])
        else:
            encoded = tokenizer.encode_batch([prompts[i].text for i in picked])
        for i, ids in zip(picked, encoded):
            out[i] = np.asarray(ids, np.int32)
    return out


def load_prompts(sources: list[str], data_cfg: DataConfig, tokenizer: Tokenizer, max_prompt_tokens: int,
                 stats: PromptStats, chunk: int = 1024) -> list[EncodedPrompt]:
    """Every good prompt of ``sources`` encoded, length-checked (``data.overlong``), with drops counted in
    ``stats``."""
    out: list[EncodedPrompt] = []
    for pending in parsed_rows(sources, data_cfg, stats, chunk):
        for (where, prompt), ids in zip(pending, encode_prompts(tokenizer, [p for _, p in pending])):
            if data_cfg.max_prompt_length is not None and len(ids) > data_cfg.max_prompt_length:
                ids = ids[len(ids) - data_cfg.max_prompt_length:]
                stats.prompts_cut += 1
            if len(ids) > max_prompt_tokens:
                if data_cfg.overlong == "raise":
                    raise overlong_error(where, len(ids), max_prompt_tokens, _LIMIT, _REMEDY)
                if data_cfg.overlong == "drop":
                    stats.dropped["overlong"] += 1
                    continue
                ids = ids[len(ids) - max_prompt_tokens:]  # the last tokens: the reply follows them
                stats.truncated += 1
            out.append(EncodedPrompt(where, prompt, ids))
    return out


def prepare_prompts(data_cfg: DataConfig, tokenizer: Tokenizer, max_prompt_tokens: int) -> PromptData:
    """Read, encode and split the prompts (see the module docstring), each at most ``max_prompt_tokens`` long."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens}: a prompt needs at least one token")
    completion_settings(data_cfg, tokenizer)
    stats = PromptStats(max_prompt_tokens=max_prompt_tokens)
    train, val = split_rows(
        data_cfg, lambda sources: load_prompts(sources, data_cfg, tokenizer, max_prompt_tokens, stats),
        lambda r: r.ids.tobytes(), stats, "prompts")
    stats.train_prompts, stats.val_prompts = len(train), len(val)
    stats.longest = max(len(r.ids) for r in train)
    return PromptData(PromptRows(train, max_prompt_tokens), PromptRows(val, max_prompt_tokens) if val else None,
                      stats, max_prompt_tokens)
