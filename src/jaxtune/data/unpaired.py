"""Unpaired preference rows (``data.format: unpaired``, TRL's KTO data): rows → `Labelled` → one sequence (the prompt,
then the completion) with its label, and the sequence KTO estimates its KL baseline from: the same prompt with another
row's completion.

**Rows.** ``{"prompt", "completion", "label"}`` with text (raw: the prompt encoded alone, then the completion and
EOS) or messages (``prompt`` ending with a user turn, ``completion`` the assistant's; rendered by the chat template),
``label`` true (desirable) or false (undesirable); bad rows as for SFT (`jaxtune.data.formats`).

**Encoding.** As a preference pair's sequence (`jaxtune.data.sft.Encoder`): the loss mask on the completion's tokens
(its end-of-turn or EOS included), never on the prompt's. Over ``seq_len + 1`` tokens: ``data.overlong`` truncate
(the prompt from the left first, down to one token, then the completion from the right), drop or raise; a prompt
over ``data.max_prompt_length`` keeps its last tokens first.

**KL rows.** KTO's KL term compares policy and reference on mismatched (prompt, completion) pairs. As TRL does, the
training rows are taken in order in chunks of the batch size, and within each chunk row i's KL sequence is its own
prompt's tokens followed by the completion tokens of the row before it (the first row takes the chunk's last), cut
at ``seq_len + 1`` tokens. Held-out rows likewise; then their items (each with its KL row) are put in an order that
spreads each label evenly (`mixed_labels`), so every held-out batch holds both where the split does, whatever the
sources' order (``data.unpair`` gives all the chosen halves first).

**One label.** Training rows all of one label train (KTO's loss is defined per row) but have no rewards of the other
label to set theirs against: a warning at start names the sources (`label_warnings`), and the other label's rewards
and the margin are not logged (never 0).

**Items.** `UnpairedRows` item ``i`` is row ``i``: arrays (2, T), row 0 its sequence and row 1 its KL sequence, each
right-padded (segment 0, no loss), and ``labels`` (2,) float32: 1.0 for desirable, 0.0 for undesirable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.data.encoded import Encoded, Examples, PackedRows
from jaxtune.data.formats import Example, Labelled
from jaxtune.data.row_policy import RowStats, completion_settings, overlong_error, parsed_rows, split_rows
from jaxtune.data.sft import Encoder
from jaxtune.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class EncodedRow:
    """A row's sequence (prompt then completion), where its prompt ends, and its label."""

    sequence: Encoded
    prompt: int
    label: bool


def kl_sequences(rows: list[EncodedRow], chunk: int, limit: int) -> list[Encoded]:
    """Each row's KL sequence: its prompt's tokens, then the completion of the row before it in its chunk of
    ``chunk`` rows (the first row: the chunk's last), at most ``limit`` tokens."""
    out = []
    for start in range(0, len(rows), chunk):
        group = rows[start:start + chunk]
        for k, row in enumerate(group):
            other = group[k - 1]
            ids = np.concatenate([row.sequence.ids[:row.prompt], other.sequence.ids[other.prompt:]])[:limit]
            mask = np.concatenate([np.zeros(row.prompt, bool), other.sequence.mask[other.prompt:]])[:limit]
            out.append(Encoded(ids.astype(np.int32), mask))
    return out


def mixed_labels(labels: list[bool]) -> list[int]:
    """The indexes of ``labels`` in an order that spreads each label evenly over it, each label's own order kept:
    the k-th of a label's n rows goes at (k + 1/2) / n of the way (desirable first on a tie), so any run of rows
    holds both labels in about the split's proportion. Deterministic."""
    n = {label: labels.count(label) for label in (True, False)}
    seen = {True: 0, False: 0}
    where = []
    for i, label in enumerate(labels):
        where.append(((seen[label] + 0.5) / n[label], not label, i))
        seen[label] += 1
    return [i for *_, i in sorted(where)]


class UnpairedRows:
    """Grain random-access source: item ``i`` is row ``i``, {"inputs", "targets", "positions", "segment_ids"}: int32
    (2, T), "loss_mask": float32 (2, T) (row 0 the sequence, row 1 its KL sequence) and "labels": float32 (2,); with
    reference log-probs (`with_reference`) also "ref_logps": float32 (2,)."""

    def __init__(self, rows: PackedRows, labels: np.ndarray, ref_logps: np.ndarray | None = None):
        self.rows = rows  # sequence 2i is row i's, 2i + 1 its KL sequence
        self.labels = labels  # float32 (len,)
        self.ref_logps = ref_logps  # float32 (len, 2): the reference's summed completion log-probs of both, or None

    def with_reference(self, logps: np.ndarray) -> UnpairedRows:
        """These rows with the reference model's log-probs, ``logps``: (len, 2), the summed completion log-probs of
        each row's sequence and of its KL sequence (objective.precompute_ref_logps)."""
        logps = np.asarray(logps, np.float32)
        if logps.shape != (len(self), 2):
            raise ValueError(f"reference log-probs have shape {logps.shape}; {len(self)} rows need ({len(self)}, 2)")
        return UnpairedRows(self.rows, self.labels, logps)

    @classmethod
    def of(cls, rows: list[EncodedRow], seq_len: int, chunk: int, mixed: bool = False) -> UnpairedRows:
        """The items of ``rows``, KL rows made in chunks of ``chunk`` (`kl_sequences`); ``mixed``: the items then in
        `mixed_labels` order (held-out batches, which are taken in order)."""
        kl = kl_sequences(rows, chunk, seq_len + 1)
        order = mixed_labels([row.label for row in rows]) if mixed else range(len(rows))
        examples = Examples.of([enc for i in order for enc in (rows[i].sequence, kl[i])])
        return cls(PackedRows(examples, [[k] for k in range(len(examples))], seq_len),
                   np.array([rows[i].label for i in order], np.float32))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        own, kl = self.rows[2 * i], self.rows[2 * i + 1]
        out = {k: np.stack([own[k], kl[k]]) for k in own}
        out["labels"] = np.full(2, self.labels[i], np.float32)
        if self.ref_logps is not None:
            out["ref_logps"] = self.ref_logps[i].copy()
        return out


@dataclass
class UnpairedStats(RowStats):
    train_rows: int = 0
    val_rows: int = 0
    desirable: int = 0  # training rows labelled true
    val_desirable: int = 0  # held-out rows labelled true

    def lines(self) -> list[str]:
        return [(f"unpaired preference data: {self.rows} rows -> {self.train_rows} training ({self.desirable} "
                 f"desirable, {self.train_rows - self.desirable} undesirable) and {self.val_rows} held-out"),
                *self.drop_lines("rows")]


@dataclass
class UnpairedData:
    train: UnpairedRows
    val: UnpairedRows | None
    stats: UnpairedStats
    held_out: list[Example] = field(default_factory=list)  # the held-out desirable rows' Examples, not truncated


def load_unpaired(sources: list[str], data_cfg: DataConfig, tokenizer: Tokenizer, stats: UnpairedStats,
                  chunk: int = 1024) -> list[EncodedRow]:
    """Every good row of ``sources`` encoded, length-checked (``data.max_prompt_length``, ``data.overlong``), with
    drops counted in ``stats``."""
    encoder = Encoder(tokenizer, data_cfg, cached=True)
    limit = data_cfg.seq_len + 1
    out: list[EncodedRow] = []
    for pending in parsed_rows(sources, data_cfg, stats, chunk):
        rows: list[Labelled] = [r for _, r in pending]
        encoded: list[Encoded | None] = [None] * len(rows)
        for chat in (False, True):  # text and conversational rows may mix, each tokenized its way
            picked = [i for i, r in enumerate(rows) if bool(r.example.messages) == chat]
            if picked:
                for i, enc in zip(picked, encoder.encode_rows([(pending[i][0], rows[i].example) for i in picked],
                                                              [rows[i].prompt_turns for i in picked])):
                    encoded[i] = enc
        for (where, row), enc in zip(pending, encoded):  # in the sources' order
            fitted = _fitted(where, enc, data_cfg, limit, stats)
            if fitted is not None:
                out.append(EncodedRow(fitted[0], fitted[1], row.label))
    return out


def _fitted(where: str, enc: Encoded, data_cfg: DataConfig, limit: int,
            stats: UnpairedStats) -> tuple[Encoded, int] | None:
    """``enc`` and its prompt's length, cut to ``data.max_prompt_length`` and ``data.overlong``'s rule; None when
    dropped."""
    prompt = int(np.argmax(enc.mask))
    if data_cfg.max_prompt_length is not None and prompt > data_cfg.max_prompt_length:
        cut = prompt - data_cfg.max_prompt_length
        enc, prompt = Encoded(enc.ids[cut:], enc.mask[cut:]), data_cfg.max_prompt_length
        stats.prompts_cut += 1
    if len(enc.ids) > limit:
        if data_cfg.overlong == "raise":
            raise overlong_error(where, len(enc.ids), limit)
        if data_cfg.overlong == "drop":
            stats.dropped["overlong"] += 1
            return None
        cut = prompt - min(prompt, max(1, limit - (len(enc.ids) - prompt)))  # the prompt's start, then the end
        enc, prompt = Encoded(enc.ids[cut:cut + limit], enc.mask[cut:cut + limit]), prompt - cut
        stats.truncated += 1
    if len(enc.ids) < 2 or not enc.mask[1:].any():
        stats.dropped["no_trainable_tokens"] += 1
        return None
    return enc, prompt


def label_warnings(data_cfg: DataConfig, stats: UnpairedStats) -> list[str]:
    """A warning line for each split whose rows are all of one label (`UnpairedStats`), naming its sources."""
    lines = (_one_label("training", data_cfg.sources, stats.train_rows, stats.desirable,
                        "add rows of the other label, or read preference pairs with data.unpair=true"),
             _one_label("held-out", data_cfg.val_sources or data_cfg.sources, stats.val_rows, stats.val_desirable,
                        "give data.val_sources with both labels, or raise data.val_fraction"))
    return [line for line in lines if line]


def _one_label(split: str, sources: list[str], rows: int, desirable: int, fix: str) -> str | None:
    """The warning for a split of ``rows`` rows, ``desirable`` of them labelled true, when all share one label."""
    if not rows or 0 < desirable < rows:
        return None
    label, missing = (("desirable (label true)", "rewards/rejected") if desirable else
                      ("undesirable (label false)", "rewards/chosen"))
    return (f"warning: {', '.join(sources)}: all {rows} {split} rows are {label}: {missing} and rewards/margins have "
            f"no rows to be measured on and are not reported; {fix}")


def _tokens(row: EncodedRow) -> bytes:
    return row.sequence.ids.tobytes() + bytes([row.label])


def prepare_unpaired(data_cfg: DataConfig, tokenizer: Tokenizer, batch_size: int) -> UnpairedData:
    """Read, encode and split the rows (see the module docstring); KL sequences in chunks of ``batch_size``."""
    completion_settings(data_cfg, tokenizer)
    stats = UnpairedStats()
    train, val = split_rows(data_cfg, lambda sources: load_unpaired(sources, data_cfg, tokenizer, stats), _tokens,
                            stats, "rows")
    stats.train_rows, stats.val_rows = len(train), len(val)
    stats.desirable, stats.val_desirable = sum(r.label for r in train), sum(r.label for r in val)
    return UnpairedData(UnpairedRows.of(train, data_cfg.seq_len, batch_size),
                        UnpairedRows.of(val, data_cfg.seq_len, batch_size, mixed=True) if val else None, stats,
                        [r.sequence.example for r in val if r.label and r.sequence.example is not None])
