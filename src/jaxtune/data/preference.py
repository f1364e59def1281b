"""Preference pairs (``data.format: preference``, TRL's conventions): rows → `Pair`s → a chosen and a rejected
sequence after the same prompt, as ids with a loss mask → one pair per item, arrays of shape (2, T).

**Rows.** Read and understood as SFT rows are (`jaxtune.data.formats`: the three forms, the bad-row reasons, which
``data.bad_rows`` raises with file:line or counts).

**Encoding.** Each sequence is the prompt, then one completion, encoded as SFT encodes a row (`jaxtune.data.sft`'s
`Encoder`): a conversational pair is rendered by the chat template (``data.chat_template`` or the tokenizer's), the
loss on the completion's assistant turns (each one's content and end-of-turn) and never on the prompt's; a text pair
is raw text, the prompt encoded alone and the completion alone then EOS, the loss on the completion and EOS. The two
sequences start with the same prompt ids (checked). ``data.loss_on`` must stay ``assistant``: the loss of a pair is on
its completions. Text pairs need no chat template; a conversational pair without one is an error that says to set
``data.chat_template``.

**Length.** A sequence of ``n`` tokens fills ``n - 1`` positions (inputs ``[:-1]``, targets ``[1:]``), so each may
hold ``seq_len + 1`` tokens. A prompt over ``data.max_prompt_length`` tokens first keeps its last ones (counted,
whatever ``data.overlong`` says). A longer pair is truncated, dropped or raises (``data.overlong``): truncation cuts the
prompt from the left first, down to one token, then the completions from the right (TRL's ``keep_end`` prompt and
``keep_start`` completion). A pair left with a completion without trained token is dropped (``no_trainable_tokens``):
a pair compares two completions.

**Items.** `PairRows` item ``i`` holds pair ``i`` alone, row 0 the chosen sequence and row 1 the rejected one, each
right-padded (segment 0, no loss): the objective compares whole sequences, so pairs are never packed, whatever
``data.packing`` says. `PairRows.with_reference` adds the reference model's summed completion log-probs of each pair
(``ref_logps``), computed once before training (DPO's ``precompute_ref_logps``).

**Held out.** ``data.val_fraction`` of the pairs, by a hash of their tokens (identical pairs share a split), or
``data.val_sources``. The held-out pairs' chosen conversations (not truncated) are the questions
(`jaxtune.data.sft.question`) the evaluations ask: the prompt, and the chosen reply as the reference answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.data.encoded import Encoded, Examples, PackedRows, shared_row
from jaxtune.data.errors import DataError
from jaxtune.data.formats import Example, Pair
from jaxtune.data.row_policy import RowStats, completion_settings, overlong_error, parsed_rows, split_rows
from jaxtune.data.sft import Encoder
from jaxtune.data.tokenizer import Tokenizer


class EncodedPair(tuple):
    """(chosen, rejected) `Encoded`, each the prompt then its completion; and the pair's ``margin`` (None: its row
    gives none)."""

    margin: float | None

    def __new__(cls, sides: tuple[Encoded, Encoded], margin: float | None = None) -> Self:
        pair = super().__new__(cls, tuple(sides))
        pair.margin = margin
        return pair


class PairRows:
    """Grain random-access source: item ``i`` is pair ``i``, {"inputs", "targets", "positions", "segment_ids"}:
    int32 (2, T) and "loss_mask": float32 (2, T), row 0 the chosen sequence and row 1 the rejected one, each from
    position 0 then padding (segment 0); with reference log-probs (`with_reference`) also "ref_logps": float32 (2,).

    ``shared`` (``data.share_prompts``): item ``i`` is one row of 2T positions instead, the pair's prompt once then
    the chosen and the rejected completion (`shared_row`), with "branch_ids" int32 (2T,).
    """

    def __init__(self, rows: PackedRows, ref_logps: np.ndarray | None = None, shared: bool = False,
                 margins: np.ndarray | None = None):
        self.rows = rows  # one sequence per bin: 2i the chosen of pair i, 2i + 1 its rejected
        self.ref_logps = ref_logps  # float32 (len, 2) or None
        self.shared = shared
        self.margins = margins  # float32 (len, 2): each pair's margin on both sequences (0 where its row gives none)

    @classmethod
    def of(cls, pairs: list[EncodedPair], seq_len: int, shared: bool = False, margins: bool = False) -> PairRows:
        """``margins``: each item also carries its pair's "margin", float32 (2,): the margin on both sequences (0
        where the row gives none), for a reward model's loss."""
        examples = Examples.of([enc for pair in pairs for enc in pair])
        given = (np.repeat(np.array([getattr(p, "margin", None) or 0.0 for p in pairs], np.float32)[:, None], 2, 1)
                 if margins else None)
        return cls(PackedRows(examples, [[k] for k in range(len(examples))], seq_len), shared=shared, margins=given)

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if self.shared:
            sequences = [self.rows.examples.row(2 * i), self.rows.examples.row(2 * i + 1)]
            out = shared_row(sequences, int(np.argmax(sequences[0][1])), 2 * self.rows.seq_len)
        else:
            chosen, rejected = self.rows[2 * i], self.rows[2 * i + 1]
            out = {k: np.stack([chosen[k], rejected[k]]) for k in chosen}
        if self.ref_logps is not None:
            out["ref_logps"] = self.ref_logps[i].copy()
        if self.margins is not None:
            out["margin"] = self.margins[i].copy()
        return out

    def with_reference(self, logps: np.ndarray) -> PairRows:
        """These pairs with the reference model's log-probs, ``logps``: (len, 2), each pair's summed completion
        log-probs, chosen then rejected."""
        logps = np.asarray(logps, np.float32)
        if logps.shape != (len(self), 2):
            raise ValueError(f"reference log-probs have shape {logps.shape}; {len(self)} pairs need ({len(self)}, 2)")
        return PairRows(self.rows, logps, self.shared, self.margins)


@dataclass
class PreferenceStats(RowStats):
    train_pairs: int = 0
    val_pairs: int = 0
    trained_tokens: int = 0  # targets with loss, chosen and rejected, training split
    margins: int = 0  # pairs whose row gives a margin
    reads_margins: bool = False  # the objective reads them (a reward model's)

    def lines(self) -> list[str]:
        read = (f"; {self.margins} with a margin, which the reward model's loss subtracts" if self.reads_margins
                else f"; {self.margins} with a margin, which only objective.name=reward reads (ignored here)")
        return [(f"preference data: {self.rows} rows -> {self.train_pairs} training and {self.val_pairs} held-out "
                 f"pairs; {self.trained_tokens} trained tokens" + (read if self.margins else "")),
                *self.drop_lines("pairs")]


@dataclass
class PreferenceData:
    train: PairRows
    val: PairRows | None
    stats: PreferenceStats
    held_out: list[Example] = field(default_factory=list)  # the held-out pairs' chosen Examples, not truncated


def encode_pairs(encoder: Encoder, pairs: list[Pair], wheres: list[str] | None = None) -> list[EncodedPair]:
    """Each pair's (chosen, rejected) sequences; text and conversational pairs may mix (each tokenized its way).
    ``wheres``: each pair's file:line, named by an error about it."""
    wheres = wheres or [f"pair {i}" for i in range(len(pairs))]
    out: list[EncodedPair | None] = [None] * len(pairs)
    for chat in (False, True):
        picked = [i for i, pair in enumerate(pairs) if bool(pair.chosen.messages) == chat]
        if not picked:
            continue
        encoded = encoder.encode_rows([(wheres[i], ex) for i in picked for ex in (pairs[i].chosen, pairs[i].rejected)],
                                      [pairs[i].prompt_turns for i in picked for _ in range(2)])
        for k, i in enumerate(picked):
            out[i] = (encoded[2 * k], encoded[2 * k + 1])
    return out


def prompt_length(where: str, pair: EncodedPair) -> int:
    """Tokens of the prompt both sequences of ``pair`` start with: those before the first trained one."""
    chosen, rejected = pair
    n = int(np.argmax(chosen.mask))
    if n != int(np.argmax(rejected.mask)) or not np.array_equal(chosen.ids[:n], rejected.ids[:n]):
        raise DataError(f"{where}: the prompt's tokens differ before the chosen and the rejected completion (the chat "
                        "template renders the prompt according to what follows it); set data.chat_template (e.g. "
                        "chatml)")
    return n


def load_pairs(sources: list[str], data_cfg: DataConfig, tokenizer: Tokenizer, stats: PreferenceStats,
               chunk: int = 1024) -> list[EncodedPair]:
    """Every good pair of ``sources`` encoded, length-checked (``data.overlong``), with drops counted in
    ``stats``."""
    encoder = Encoder(tokenizer, data_cfg, cached=True)
    limit = data_cfg.seq_len + 1
    out: list[EncodedPair] = []
    for pending in parsed_rows(sources, data_cfg, stats, chunk):
        encoded = encode_pairs(encoder, [p for _, p in pending], [w for w, _ in pending])
        for (where, parsed), pair in zip(pending, encoded):
            prompt = prompt_length(where, pair)
            if data_cfg.max_prompt_length is not None and prompt > data_cfg.max_prompt_length:
                cut, prompt = prompt - data_cfg.max_prompt_length, data_cfg.max_prompt_length
                pair = tuple(Encoded(enc.ids[cut:], enc.mask[cut:]) for enc in pair)
                stats.prompts_cut += 1
            longest = max(len(enc.ids) for enc in pair)
            if longest > limit:
                if data_cfg.overlong == "raise":
                    raise overlong_error(where, longest, limit)
                if data_cfg.overlong == "drop":
                    stats.dropped["overlong"] += 1
                    continue
                # The prompt loses its start first (down to one token), then the completions their ends.
                cut = prompt - min(prompt, max(1, limit - (longest - prompt)))
                pair = tuple(Encoded(enc.ids[cut:cut + limit], enc.mask[cut:cut + limit]) for enc in pair)
                if all(enc.mask[1:].any() for enc in pair):
                    stats.truncated += 1
            if not all(len(enc.ids) >= 2 and enc.mask[1:].any() for enc in pair):
                stats.dropped["no_trainable_tokens"] += 1
                continue
            stats.margins += parsed.margin is not None
            out.append(EncodedPair(pair, parsed.margin))
    return out


def _tokens(pair: EncodedPair) -> bytes:
    chosen, rejected = pair
    return np.int64(len(chosen.ids)).tobytes() + chosen.ids.tobytes() + rejected.ids.tobytes()


def prepare_preference(data_cfg: DataConfig, tokenizer: Tokenizer, margins: bool = False) -> PreferenceData:
    """Read, encode and split the preference pairs (see the module docstring); ``margins``: each item carries its
    pair's margin (`PairRows.of`)."""
    completion_settings(data_cfg, tokenizer)
    stats = PreferenceStats(reads_margins=margins)
    train, val = split_rows(data_cfg, lambda sources: load_pairs(sources, data_cfg, tokenizer, stats), _tokens,
                            stats, "pairs")
    stats.train_pairs, stats.val_pairs = len(train), len(val)
    stats.trained_tokens = int(sum(int(enc.mask[1:].sum()) for pair in train for enc in pair))
    shared = data_cfg.shares_prompts
    return PreferenceData(PairRows.of(train, data_cfg.seq_len, shared, margins),
                          PairRows.of(val, data_cfg.seq_len, shared, margins) if val else None, stats,
                          [chosen.example for chosen, _ in val if chosen.example is not None])
