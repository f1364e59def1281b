r"""Supervised fine-tuning data: rows → conversations → token ids with a loss mask → packed fixed-length rows.

**Rows.** Rows are read from ``data.sources`` (`jaxtune.data.rows`) and understood as ``data.format`` says
(`jaxtune.data.formats`); a bad row stops the run (``data.bad_rows=raise``, with its file:line) or is counted per
reason and skipped (``drop``).

**Loss mask without template markers.** The conversation is rendered with the tokenizer's chat template (or
``data.chat_template``). Each assistant reply is trained on as that text renders it, from the end of its generation
prompt through the template's end-of-turn (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``</s>``), which the
model must learn to emit; trailing whitespace is not trained. It is found in one of two ways. The fast way needs the
template to render a prefix of the conversation as a prefix of the text, as ChatML, Llama 3, Gemma and Mistral v7
do: for each assistant turn ``i``, the conversation up to turn ``i`` with the generation prompt (``P``) and up to
and including turn ``i`` (``F``) are rendered, and the reply is ``F[len(P):]``. Templates that render a turn
differently once later turns follow take the other way: Qwen 3 drops the reasoning of replies before the last user
message and opens later ones with a ``<think>`` block; Mistral v0.3 and Nemo move the system message into the last
user turn. There the conversation is rendered again with a placeholder for the reply, and the text that follows the
placeholder, found at the end of the real rendering, marks where the reply's content ends. The reply starts where
its generation prompt ends: after the rendering of the conversation before it (the same text, or its longest tail
found since the previous reply), at the latest occurrence of the generation prompt (or of its longest head, when the
template leaves part of it out of an earlier turn). A template that does not render a reply's content where a
placeholder can show it is an error that says so (``data.loss_on=all`` still works).

For Qwen 3 the trained span is what the model emits after its generation prompt ``<|im_start|>assistant\n``:
``content<|im_end|>`` for a reply before the last user message (the template renders it without its reasoning) and
``<think>\n{reasoning}\n</think>\n\n{content}<|im_end|>`` for a reply after it, the ``<think>`` block included even
when empty, as Qwen 3's ``{% generation %}`` training templates mark it: the model learns to open and close the
block it meets at inference. The reasoning comes from a turn's ``reasoning_content`` or from ``<think>...</think>``
at the start of its content. A template that sets ``enable_thinking`` false puts the empty block in the generation
prompt, and it is then not trained.

The text is encoded piece by piece (prompt pieces, reply pieces), so a reply's tokens are exactly those the model
produces after the prompt at inference time.
``data.loss_on``: ``assistant`` (every assistant turn), ``last_assistant``, or ``all`` (every token).

**Length.** A row of ``n`` tokens fills ``n - 1`` positions (inputs ``[:-1]``, targets ``[1:]``). Rows longer than
``seq_len + 1`` tokens are truncated, dropped or raise (``data.overlong``); a row left with no trained token is
dropped (reason ``no_trainable_tokens``), so no sequence is ever all padding by accident.

**Packing.** Rows are packed best-fit-decreasing into sequences of ``seq_len`` positions. Each row in a sequence
has its own segment id (1, 2, ...; padding is 0) and positions restarting at 0, and attention never crosses
segments, so a packed row computes exactly what it would alone. With ``data.packing=false`` every sequence holds
one row, padded. Either way every batch has the one shape (B, seq_len): the step compiles once.

**Questions.** The held-out rows (not truncated) are kept as `Example`s too: `question` turns one into the prompt the
model sees at inference (the conversation up to its last assistant turn, with the generation prompt) and the reply
it should give, which the training loop's evaluations score by exact match (``eval.exact_match``).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.data.chat import REPLY_PLACEHOLDER, end_of_turn, resolve_chat_template
from jaxtune.data.encode_cache import EncodeCache
from jaxtune.data.encoded import Encoded, Examples, PackedRows
from jaxtune.data.errors import DataError
from jaxtune.data.formats import Example
from jaxtune.data.row_policy import RowStats, overlong_error, parsed_rows, split_rows
from jaxtune.data.tokenizer import Tokenizer

# --- conversations -> token ids + loss mask ---

class Encoder:
    """Conversations -> (ids, mask) with the tokenizer's chat template, as the module docstring describes."""

    def __init__(self, tokenizer: Tokenizer, data_cfg: DataConfig, cached: bool = False):
        """``cached``: keep what `encode` makes in ``data.cache_dir`` and read it back (`EncodeCache`): a run's data,
        not the rows a run makes as it goes."""
        self.tok = tokenizer
        self.loss_on = data_cfg.loss_on
        self.cache = EncodeCache(data_cfg.cache_dir, tokenizer, self.loss_on) if cached and data_cfg.cache_dir \
            else None

    def pieces(self, ex: Example, prompt_turns: int = 0) -> list[tuple[str, bool]]:
        """The rendered text as (piece, trained) in order; assistant turns before ``prompt_turns`` (a preference
        pair's prompt, `jaxtune.data.preference`) are not trained."""
        if not ex.messages:
            return [(ex.prompt, self.loss_on == "all"), (ex.completion, True)]
        msgs = [dict(m) for m in ex.messages]
        full = self.renderer(ex.tools)(msgs)
        _check_tool_rendering(msgs, full)
        if self.loss_on == "all":
            return [(full, True)]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i >= prompt_turns]
        if self.loss_on == "last_assistant":
            turns = turns[-1:]
        spans = self.prefix_spans(msgs, full, turns, ex.tools)
        if spans is None:
            spans = self.located_spans(msgs, full, turns, ex.tools)
        pieces, pos = [], 0
        for (start, end), i in zip(spans, turns):
            missing = [c["function"]["name"] for c in msgs[i].get("tool_calls", ())
                       if c["function"]["name"] not in full[start:end]]
            if missing:
                raise DataError(f"turn {i}'s tool call of {missing[0]!r} is not rendered inside its reply, so it "
                                "cannot be trained; set data.chat_template to a template that renders tool calls "
                                "(chatml-tools, or the model's own: Qwen 2.5/3's, Llama 3.x's, Mistral's)")
            pieces += [(full[pos:start], False), (full[start:end], True)]
            pos = end
        pieces.append((full[pos:], False))
        return [p for p in pieces if p[0]]

    def prefix_spans(self, msgs: list[dict], full: str, turns: list[int],
                     tools: tuple[dict, ...] = ()) -> list[tuple[int, int]] | None:
        """Each turn's reply as ``full[start:end]``, when the template (with the row's ``tools``) renders the
        conversation up to a turn as the beginning of ``full`` (the fast way, in the module docstring); None when it
        does not."""
        render = self.renderer(tools)
        spans, pos = [], 0
        for i in turns:
            prompt = render(msgs[:i], add_generation_prompt=True)
            reply = render(msgs[: i + 1])
            end = len(reply.rstrip())
            if not (reply.startswith(prompt) and full.startswith(reply) and len(prompt) >= pos
                    and msgs[i]["content"].strip() in full[len(prompt):end]):
                return None
            spans.append((len(prompt), end))
            pos = end
        return spans


    def located_spans(self, msgs: list[dict], full: str, turns: list[int],
                      tools: tuple[dict, ...] = ()) -> list[tuple[int, int]]:
        """Each turn's reply as ``full[start:end]``, found without prefix stability (the module docstring): where the
        reply ends, from a rendering with a placeholder for it (its tool calls left out, so that the text after the
        placeholder is the turn's end-of-turn and what follows); where the reply starts, by aligning the rendering of
        the conversation before it, then the generation prompt, with ``full``."""
        render, eot = self.renderer(tools), end_of_turn(self.tok)
        spans, pos = [], 0
        for i in turns:
            placeholder = {**{k: v for k, v in msgs[i].items() if k != "tool_calls"}, "content": REPLY_PLACEHOLDER}
            probe = render([*msgs[:i], placeholder, *msgs[i + 1:]])
            at = probe.find(REPLY_PLACEHOLDER)
            after = probe[at + len(REPLY_PLACEHOLDER):]
            if at < 0 or REPLY_PLACEHOLDER in after or not full.endswith(after):
                raise DataError("the chat template does not render an assistant turn's content where it can be found "
                                "(a placeholder reply rendered in its place changes the rest of the text or is "
                                "missing), so the assistant's tokens cannot be located; set data.chat_template to a "
                                "template that renders each reply (e.g. chatml) or data.loss_on=all")
            content_end = len(full) - len(after)
            # The text before the turn can differ from the probe's where the template moves the turn's reasoning
            # into a <think> block (Qwen 3); it is the same up to that point.
            content_bound = min(at, _shared_prefix(full, probe), content_end)
            if not full.startswith(eot, content_end) or content_bound < pos:
                raise DataError("the chat template does not close each assistant reply with its end-of-turn "
                                f"({eot!r}) in the order of the conversation, so the assistant's tokens cannot be "
                                "located; set data.chat_template (e.g. chatml) or data.loss_on=all")
            # The reply starts where the generation prompt ends: after the conversation before it (the same text,
            # or its longest tail found since the previous reply: Mistral moves the system message), the latest
            # occurrence of the generation prompt, or of its longest head (it can hold text, like an empty <think>
            # block, that the template leaves out of an earlier turn).
            with_prompt = render(msgs[:i], add_generation_prompt=True)
            before = with_prompt[:_shared_prefix(with_prompt, render(msgs[:i]))]
            if full.startswith(before) and pos <= len(before) <= content_bound:
                start = len(before)
            else:
                start = pos + _latest_end(full[pos:content_bound], before, tail=True)
            start += _latest_end(full[start:content_bound], with_prompt[len(before):], tail=False)
            spans.append((start, content_end + len(eot)))
            pos = content_end + len(eot)
        return spans

    def renderer(self, tools: tuple[dict, ...] = ()):
        """The chat template as a function of (messages, add_generation_prompt), rendering ``tools``."""
        return functools.partial(self.tok.apply_chat_template, tools=list(tools) or None)

    def encode(self, examples: list[Example], prompt_turns: list[int] | None = None) -> list[Encoded]:
        """Each example's (ids, mask); ``prompt_turns``: each one's, as `pieces` takes it (default 0)."""
        if self.cache is None:
            return self._encode(examples, prompt_turns)
        key = self.cache.key(examples, prompt_turns)
        out = self.cache.read(key, examples)
        if out is None:
            out = self._encode(examples, prompt_turns)
            self.cache.write(key, out)
        return out

    def encode_rows(self, rows: list[tuple[str, Example]],
                    prompt_turns: list[int] | None = None) -> list[Encoded]:
        """`encode` of rows read at ``where`` (file:line): a row the template cannot render as a training row is a
        `DataError` naming it."""
        try:
            return self.encode([ex for _, ex in rows], prompt_turns)
        except DataError:
            for k, (where, ex) in enumerate(rows):
                try:
                    self.pieces(ex, prompt_turns[k] if prompt_turns else 0)
                except DataError as e:
                    raise DataError(f"{where}: {e}") from None
            raise

    def _encode(self, examples: list[Example], prompt_turns: list[int] | None) -> list[Encoded]:
        all_pieces = [self.pieces(ex, k) for ex, k in zip(examples, prompt_turns or [0] * len(examples))]
        flat = [text for pieces in all_pieces for text, _ in pieces]
        chat = bool(examples) and bool(examples[0].messages)
        ids_flat = self.tok.encode_chat(flat) if chat else self.tok.encode_batch(flat)
        out, k = [], 0
        for ex, pieces in zip(examples, all_pieces):
            ids: list[int] = [] if ex.messages else list(self.tok.bos_prefix)  # a template writes its own BOS
            mask: list[bool] = [False] * len(ids)
            for _, trained in pieces:
                ids += ids_flat[k]
                mask += [trained] * len(ids_flat[k])
                k += 1
            if not ex.messages:  # raw prompt/completion: the completion ends with EOS
                ids.append(self.tok.eos_id)
                mask.append(True)
            out.append(Encoded(np.asarray(ids, np.int32), np.asarray(mask, bool), ex))
        return out


def _check_tool_rendering(msgs: list[dict], full: str) -> None:
    """A conversation with tool calls or results needs a template that renders them: each call's name and each
    result is in the text (a plain template drops them without a word)."""
    for i, m in enumerate(msgs):
        names = [c["function"]["name"] for c in m.get("tool_calls", ())]
        missing = next((n for n in names if n not in full), None) if names else None
        if missing or (m["role"] == "tool" and m["content"].strip() not in full):
            what = f"the tool call of {missing!r}" if missing else "the tool result"
            raise DataError(f"the chat template does not render {what} of turn {i}, so it would be dropped from the "
                            "row without a word; set data.chat_template: chatml-tools or the model's own template "
                            "(Qwen 2.5/3's, Llama 3.x's and Mistral's render tool calls and results)")


def _shared_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # a[:k] == b[:k] holds up to the answer and not beyond: bisect on k
        k = (lo + hi + 1) // 2
        lo, hi = (k, hi) if a[:k] == b[:k] else (lo, k - 1)
    return lo


def _latest_end(window: str, text: str, tail: bool) -> int:
    """Where in ``window`` the latest occurrence of ``text``'s longest tail (``tail``) or head that occurs there
    ends; 0 if none does."""
    def part(k: int) -> str:
        return text[len(text) - k:] if tail else text[:k]

    short, long = 0, min(len(text), len(window))
    while short < long:  # a part that occurs has every shorter part occur too: bisect on its length
        k = (short + long + 1) // 2
        short, long = (k, long) if part(k) in window else (short, k - 1)
    return window.rfind(part(short)) + short if short else 0


def question(tokenizer: Tokenizer, ex: Example) -> tuple[list[int], str]:
    """A row as (prompt ids, reference answer), as the model meets it at inference: the conversation up to its last
    assistant turn rendered by the chat template with the generation prompt, and that turn's content; for
    prompt/completion rows, the prompt's ids (after the tokenizer's BOS, as in training) and the completion."""
    if not ex.messages:
        return [*tokenizer.bos_prefix, *tokenizer.encode(ex.prompt)], ex.completion
    last = max(i for i, m in enumerate(ex.messages) if m["role"] == "assistant")
    prompt = tokenizer.apply_chat_template([dict(m) for m in ex.messages[:last]], add_generation_prompt=True,
                                           tools=list(ex.tools) or None)
    return tokenizer.encode_chat([prompt])[0], ex.messages[last]["content"]


# --- packing, the prepared data ---

def pack(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: rows of ``sizes`` (each ≤ capacity) into as few bins of ``capacity`` as it finds.
    Deterministic: ties go to the earlier row and the earliest opened bin."""
    order = sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), sorted
    for i in order:
        need = int(sizes[i])
        k = bisect.bisect_left(free, (need, -1))
        if k == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - need, len(bins) - 1))
        else:
            space, b = free.pop(k)
            bins[b].append(i)
            bisect.insort(free, (space - need, b))
    return [sorted(b) for b in bins]


@dataclass
class SFTStats(RowStats):
    train_examples: int = 0
    val_examples: int = 0
    train_sequences: int = 0
    val_sequences: int = 0
    trained_tokens: int = 0  # targets with loss, training split
    fill: float = 0.0  # fraction of training sequence positions holding a row (the rest is padding)

    def lines(self) -> list[str]:
        return [(f"fine-tuning data: {self.rows} rows -> {self.train_examples} training and {self.val_examples} "
                 f"held-out examples; {self.train_sequences} training sequences ({self.fill:.1%} filled), "
                 f"{self.trained_tokens} trained tokens"), *self.drop_lines("rows")]


@dataclass
class SFTData:
    train: PackedRows
    val: PackedRows | None
    stats: SFTStats
    held_out: list[Example] = field(default_factory=list)  # the held-out rows not truncated, in order (`question`)


def load_examples(sources: list[str], data_cfg: DataConfig, tokenizer: Tokenizer, stats: SFTStats,
                  chunk: int = 1024) -> list[Encoded]:
    """Every good row of ``sources`` encoded, length-checked (``data.overlong``), with drops counted in ``stats``."""
    encoder = Encoder(tokenizer, data_cfg, cached=True)
    limit = data_cfg.seq_len + 1
    out: list[Encoded] = []
    for pending in parsed_rows(sources, data_cfg, stats, chunk):
        for (where, _), enc in zip(pending, encoder.encode_rows(pending)):
            if len(enc.ids) > limit:
                if data_cfg.overlong == "raise":
                    raise overlong_error(where, len(enc.ids), limit)
                if data_cfg.overlong == "drop":
                    stats.dropped["overlong"] += 1
                    continue
                enc = Encoded(enc.ids[:limit], enc.mask[:limit])
                if enc.mask[1:].any():
                    stats.truncated += 1
            if len(enc.ids) < 2 or not enc.mask[1:].any():
                stats.dropped["no_trainable_tokens"] += 1
                continue
            out.append(enc)
    return out


def prepare_sft(data_cfg: DataConfig, tokenizer: Tokenizer) -> SFTData:
    """Read, encode, split and pack the fine-tuning data (see the module docstring)."""
    resolve_chat_template(data_cfg, tokenizer)
    stats = SFTStats()
    train, val = split_rows(data_cfg, lambda sources: load_examples(sources, data_cfg, tokenizer, stats),
                            lambda r: r.ids.tobytes(), stats)
    train_set, val_set = sequences(train, data_cfg), sequences(val, data_cfg) if val else None
    stats.train_examples, stats.val_examples = len(train), len(val)
    stats.train_sequences, stats.val_sequences = len(train_set), len(val_set) if val_set else 0
    stats.trained_tokens = int(sum(int(r.mask[1:].sum()) for r in train))
    stats.fill = float(train_set.examples.positions_used.sum()) / (len(train_set) * data_cfg.seq_len)
    return SFTData(train_set, val_set, stats, [r.example for r in val if r.example is not None])


def sequences(rows: list[Encoded], data_cfg: DataConfig) -> PackedRows:
    """Encoded rows packed (or one per sequence, ``data.packing=false``) into ``data.seq_len`` sequences."""
    examples = Examples.of(rows)
    sizes = examples.positions_used
    bins = pack(sizes, data_cfg.seq_len) if data_cfg.packing else [[i] for i in range(len(rows))]
    return PackedRows(examples, bins, data_cfg.seq_len)
