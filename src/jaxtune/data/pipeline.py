"""Batches of token windows for training (a Grain pipeline) and evaluation (a fixed list), and the sequences of a
test file (`test_sequences`, for ``jaxtune eval --data``).

Training order is a pure function of ``seed``: window ``k`` of the global stream is
``shuffle(seed, epoch = k // train_windows)[k % train_windows]`` (a fresh permutation each epoch), and
global batch ``b`` is stream positions ``[b * global_batch, (b + 1) * global_batch)``. Process ``p`` of
``P`` takes the ``p``-th contiguous block of every global batch, so the processes together see exactly the
single-process batch, in its order (the global array `jaxtune.sharding.global_batch` assembles puts process ``p``'s
rows after process ``p - 1``'s: the same array, row for row, as one process builds), and the iterator position
is a checkpointable index (``get_state``/``set_state``), restored without replaying the stream.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import grain
import numpy as np

from jaxtune.config import PAIRS, PROMPTS, ROWS, UNPAIRED, WINDOWS, BatchKind, DataConfig
from jaxtune.data.chat import resolve_chat_template
from jaxtune.data.errors import DataError
from jaxtune.data.formats import Example
from jaxtune.data.preference import (
    PairRows,
    PreferenceData,
    PreferenceStats,
    load_pairs,
    prepare_preference,
)
from jaxtune.data.prompts import PromptData, prepare_prompts
from jaxtune.data.row_policy import completion_settings
from jaxtune.data.sft import SFTStats, load_examples, prepare_sft, sequences
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.data.tokens import Split, TokenData, prepare_tokens
from jaxtune.data.unpaired import (
    UnpairedData,
    UnpairedRows,
    UnpairedStats,
    label_warnings,
    load_unpaired,
    prepare_unpaired,
)

Batch = dict[str, np.ndarray]  # {"inputs": int32 (B, T), "targets": int32 (B, T)}


@runtime_checkable
class Closable(Protocol):
    """A training iterator with worker processes to stop (Grain's with ``data.num_workers`` > 0)."""

    def close(self) -> None: ...


class TextWindows:
    """Grain random-access source over one split: ``[i]`` is {"inputs": (T,), "targets": (T,)} int32.

    Holds only the ``TokenData`` (which pickles as its file path), so it travels cheaply to Grain workers.
    """

    def __init__(self, data: TokenData, split: Split):
        self._data = data
        self._split = split

    def __len__(self) -> int:
        return self._data.windows(self._split)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        window = np.asarray(self._data.window(index, self._split), dtype=np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}


def make_train_iterator(
    data: TokenData | Any,
    *,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    num_workers: int = 0,
) -> grain.DatasetIterator:
    """An endless iterator of this process's training batches: {"inputs", "targets"}: int32 (global_batch //
    process_count, seq_len) (and the SFT keys, for `jaxtune.data.encoded.PackedRows`; (..., 2, seq_len) pairs for
    `jaxtune.data.preference.PairRows`; {"prompt": (..., max_prompt_tokens), "prompt_len", "row": (...,)} for
    `jaxtune.data.prompts.PromptRows`). ``data``: pretraining `TokenData` (its training windows) or any random-access
    source of equal-shaped examples. ``get_state()`` is a JSON-serialisable dict; ``set_state`` on a fresh iterator
    made with the same arguments continues exactly where the saved one was (``num_workers`` included: the state's
    shape depends on it). Close it (``.close()``) to stop worker processes.
    """
    local_batch = _local_batch(global_batch, process_index, process_count, key="train.batch_size")
    ds = (
        grain.MapDataset.source(TextWindows(data, "train") if isinstance(data, TokenData) else data)
        .shuffle(seed=_shuffle_seed(seed))
        .repeat()  # forever; shuffle reseeds every epoch because it sees the epoch in the index
        .batch(local_batch, drop_remainder=True)  # global batch b is local batches b*P .. b*P + P-1, in order:
        .slice(slice(process_index, None, process_count))  # this process's block of each
        # A few threads read ahead; reading is a memcpy from the page cache, so more would only use memory.
        .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
    )
    if num_workers > 0:
        _parse_absl_flags()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return iter(ds)


def make_eval_batches(
    data: TokenData, *, batch_size: int, num_batches: int, process_index: int = 0, process_count: int = 1
) -> list[Batch]:
    """Up to ``num_batches`` batches of validation windows, this process's block of rows of each global
    batch of ``batch_size``. The ``n = count * batch_size`` rows are spread evenly over the split, in order:
    global row ``g`` is the middle window of the split's ``g``-th ``n``-th, ``(2g + 1) * val_windows // 2n``,
    so a few batches still sample the whole corpus, both ends included (validation blocks interleave with
    training ones all along it; see ``tokens``). Every batch is full:
    when the split holds fewer than ``batch_size`` windows, the one batch repeats each of them (so shapes
    stay fixed for the compiled eval step); otherwise no window is used twice.
    """
    if data.val_windows == 0:
        raise DataError(
            "no validation windows: data.val_fraction is 0 or the corpus is too small; raise data.val_fraction"
        )
    _local_batch(batch_size, process_index, process_count, key="batch_size")  # checks the split
    source = TextWindows(data, "val")
    count = max(1, min(num_batches, data.val_windows // batch_size))
    rows = count * batch_size
    batches = []
    for b in range(count):
        picked = [
            source[(2 * (b * batch_size + i) + 1) * data.val_windows // (2 * rows)]
            for i in _block(batch_size, process_index, process_count)
        ]
        batches.append({name: np.stack([row[name] for row in picked]) for name in ("inputs", "targets")})
    return batches


def make_sequence_batches(source: Any, *, batch_size: int, num_batches: int, process_index: int = 0,
                          process_count: int = 1) -> list[Batch]:
    """The first ``num_batches`` batches of ``source``'s sequences (or pairs) in order (this process's block of rows
    of each); the last batch is filled with empty ones (all zeros: no counted token, segment 0) so every batch has
    one shape."""
    _local_batch(batch_size, process_index, process_count, key="batch_size")
    count = min(num_batches, -(-len(source) // batch_size))
    empty = {k: np.zeros_like(v) for k, v in source[0].items()}
    batches = []
    for b in range(count):
        picked = [source[g] if g < len(source) else empty
                  for g in _block(batch_size, process_index, process_count, start=b * batch_size)]
        batches.append({name: np.stack([row[name] for row in picked]) for name in picked[0]})
    return batches


@dataclass
class TrainingData:
    """What the training loop reads: the endless training iterator, fixed held-out batches, lines to report at the
    start of training (what was read, dropped, truncated), and the held-out fine-tuning rows whole, in order (for
    exact match: `jaxtune.data.sft.question`; none for pretraining text; the chosen side of preference pairs). For
    preference data also the pairs themselves (``pairs``: to compute reference log-probs over them, then batch
    ``pairs.train.with_reference(...)`` again with `make_train_iterator`). For prompts the prompts themselves
    (``prompts``: each batch's ``row`` indexes ``prompts.train``, whose fields the rewards read), and no held-out
    batches: the completions are generated in training, so there is no fixed held-out loss."""

    train_iter: Any
    eval_batches: list[Batch]
    report: list[str]
    eval_examples: list[Example] = field(default_factory=list)
    pairs: PreferenceData | UnpairedData | None = None  # pairs, or KTO's unpaired rows (each with its KL row)
    batching: Batching | None = None  # how the pairs were batched (to batch them again with reference log-probs)
    prompts: PromptData | None = None

    @property
    def pair_sources(self) -> dict[str, PairRows]:
        """The training and (if any) held-out pairs by split name."""
        assert self.pairs is not None, "not preference data"
        return {"train": self.pairs.train, **({"val": self.pairs.val} if self.pairs.val is not None else {})}

    def with_reference(self, logps: dict[str, np.ndarray]) -> TrainingData:
        """The same pairs with their reference log-probs (``logps``: (pairs, 2) per split of `pair_sources`) in every
        batch (``ref_logps``), batched again from the start (call before restoring the iterator's position)."""
        assert self.pairs is not None, "not preference data"
        self.close()
        train = self.pairs.train.with_reference(logps["train"])
        val = self.pairs.val.with_reference(logps["val"]) if self.pairs.val is not None else None
        assert self.batching is not None
        return replace(self, train_iter=self.batching.train(train), eval_batches=self.batching.held_out(val),
                       pairs=replace(self.pairs, train=train, val=val))

    def close(self) -> None:
        """Stop Grain's worker processes (``data.num_workers`` > 0)."""
        if isinstance(self.train_iter, Closable):
            self.train_iter.close()


def make_training_data(data_cfg: DataConfig, tokenizer: Tokenizer, *, batch_size: int, seed: int, eval_batches: int,
                       process_index: int = 0, process_count: int = 1,
                       max_prompt_tokens: int | None = None, margins: bool = False) -> TrainingData:
    """The batches of ``data.format``'s batch kind (`jaxtune.config.kinds`), ``batch_size`` items each: pretraining
    windows, packed fine-tuning sequences, preference pairs (arrays (batch_size, 2, seq_len)) or prompts (arrays
    (batch_size, max_prompt_tokens), which it needs: ``data.seq_len - objective.max_completion_length``).
    ``margins``: pairs carry their margin (the objective's record says whether it reads them)."""
    batching = Batching(batch_size=batch_size, seed=seed, eval_batches=eval_batches, num_workers=data_cfg.num_workers,
                        process_index=process_index, process_count=process_count, margins=margins)
    return PIPELINES[data_cfg.kind].train(data_cfg, tokenizer, batching, max_prompt_tokens)


@dataclass(frozen=True)
class Batching:
    """How a kind's items are batched: the global batch, the shuffle seed, how many held-out batches, Grain's worker
    processes and this process's share."""

    batch_size: int
    seed: int
    eval_batches: int
    num_workers: int
    process_index: int
    process_count: int
    margins: bool = False  # preference pairs carry their margin (a reward model's loss reads it)

    @property
    def split(self) -> dict[str, int]:
        return {"process_index": self.process_index, "process_count": self.process_count}

    def train(self, source: Any) -> grain.DatasetIterator:
        return make_train_iterator(source, global_batch=self.batch_size, seed=self.seed, num_workers=self.num_workers,
                                   **self.split)

    def notes(self, train: Any, val: Any | None, what: str, key: str = "train.batch_size") -> list[str]:
        """Warnings for a batch (``key``) larger than the training split, or a held-out split smaller than a batch,
        of ``what`` (examples, pairs, prompts)."""
        out, b = [], self.batch_size
        if len(train) < b:
            out.append(f"warning: {key}={b} is more than the {len(train)} training {what}: every batch holds some "
                       f"of them more than once; lower {key} or add data")
        if val is not None and len(val) < b:
            out.append(f"warning: {len(val)} held-out {what}, fewer than a batch ({key}={b}): the held-out numbers "
                       "rest on those alone; raise data.val_fraction or give data.val_sources")
        return out

    def held_out(self, source: Any | None) -> list[Batch]:
        return (make_sequence_batches(source, batch_size=self.batch_size, num_batches=self.eval_batches, **self.split)
                if source is not None else [])


def _windows(data_cfg: DataConfig, tokenizer: Tokenizer, batching: Batching, _: int | None) -> TrainingData:
    tokens = prepare_tokens(data_cfg, tokenizer)
    val = (make_eval_batches(tokens, batch_size=batching.batch_size, num_batches=batching.eval_batches,
                             **batching.split) if tokens.val_windows else [])
    return TrainingData(batching.train(tokens), val, tokens.report())


def _rows(data_cfg: DataConfig, tokenizer: Tokenizer, batching: Batching, _: int | None) -> TrainingData:
    sft = prepare_sft(data_cfg, tokenizer)
    return TrainingData(batching.train(sft.train), batching.held_out(sft.val),
                        sft.stats.lines() + batching.notes(sft.train, sft.val, "sequences"), sft.held_out)


def _pairs(data_cfg: DataConfig, tokenizer: Tokenizer, batching: Batching, _: int | None) -> TrainingData:
    pairs = prepare_preference(data_cfg, tokenizer, batching.margins)
    return TrainingData(batching.train(pairs.train), batching.held_out(pairs.val),
                        pairs.stats.lines() + batching.notes(pairs.train, pairs.val, "pairs"), pairs.held_out, pairs,
                        batching)


def _unpaired(data_cfg: DataConfig, tokenizer: Tokenizer, batching: Batching, _: int | None) -> TrainingData:
    rows = prepare_unpaired(data_cfg, tokenizer, batching.batch_size)
    notes = label_warnings(data_cfg, rows.stats) + batching.notes(rows.train, rows.val, "rows")
    return TrainingData(batching.train(rows.train), batching.held_out(rows.val), rows.stats.lines() + notes,
                        rows.held_out, rows, batching)


def _prompts(data_cfg: DataConfig, tokenizer: Tokenizer, batching: Batching,
             max_prompt_tokens: int | None) -> TrainingData:
    if max_prompt_tokens is None:
        raise ValueError(f"data.format={data_cfg.format} needs max_prompt_tokens (data.seq_len - "
                         "objective.max_completion_length)")
    prompts = prepare_prompts(data_cfg, tokenizer, max_prompt_tokens)
    notes = batching.notes(prompts.train, None, "prompts", "objective.prompts_per_step")
    return TrainingData(batching.train(prompts.train), [], prompts.stats.lines() + notes, prompts=prompts)


def test_sequences(data_cfg: DataConfig, tokenizer: Tokenizer, data: str,
                   margins: bool = False) -> tuple[Any, dict[str, Any]]:
    """Every sequence of the test data ``data`` (a file, glob or ``hf:`` dataset in ``data_cfg``'s format), as a
    random-access source for `make_sequence_batches`, and what was read: pretraining windows (all of them, no
    held-out split), fine-tuning rows packed as for training, or preference pairs. Not prompts: their completions
    are generated, so there is no fixed sequence to score. ``margins``: preference pairs carry their margin."""
    test = PIPELINES[data_cfg.kind].test
    if test is None:
        raise DataError(f"--data {data}: held-out loss does not apply to data.format={data_cfg.format} (the "
                        "completions are generated: there is no text to score); give rows with completions and their "
                        "format, e.g. data.format=messages")
    test_cfg = data_cfg.model_copy(update={"sources": [data], "val_sources": [], "val_fraction": 0.0})
    return test(test_cfg, tokenizer, data, margins=True) if margins else test(test_cfg, tokenizer, data)


test_sequences.__test__ = False  # not a test, though pytest would collect it by its name where a test imports it


def _test_windows(test_cfg: DataConfig, tokenizer: Tokenizer, data: str) -> tuple[Any, dict[str, Any]]:
    tokens = prepare_tokens(test_cfg, tokenizer)
    return TextWindows(tokens, "train"), {"sequences": tokens.train_windows}


def _test_rows(test_cfg: DataConfig, tokenizer: Tokenizer, data: str) -> tuple[Any, dict[str, Any]]:
    resolve_chat_template(test_cfg, tokenizer)
    stats = SFTStats()
    rows = load_examples(test_cfg.sources, test_cfg, tokenizer, stats)
    return sequences(rows, test_cfg), _what_was_read(data, "rows", "examples", len(rows), stats)


def _test_pairs(test_cfg: DataConfig, tokenizer: Tokenizer, data: str,
                margins: bool = False) -> tuple[Any, dict[str, Any]]:
    completion_settings(test_cfg, tokenizer)
    stats = PreferenceStats(reads_margins=margins)
    pairs = load_pairs(test_cfg.sources, test_cfg, tokenizer, stats)
    rows = PairRows.of(pairs, test_cfg.seq_len, test_cfg.shares_prompts, margins)
    return rows, _what_was_read(data, "pairs", "pairs", len(pairs), stats)


def _test_unpaired(test_cfg: DataConfig, tokenizer: Tokenizer, data: str) -> tuple[Any, dict[str, Any]]:
    completion_settings(test_cfg, tokenizer)
    stats = UnpairedStats()
    rows = load_unpaired(test_cfg.sources, test_cfg, tokenizer, stats)
    # one chunk: each row's KL completion is the row's before it in the file (the first row's, the last row's); the
    # items then with the labels spread, so a batch of them holds both (--batches may score the first few only)
    items = UnpairedRows.of(rows, test_cfg.seq_len, max(1, len(rows)), mixed=True)
    return items, _what_was_read(data, "rows", "rows", len(rows), stats)


def _what_was_read(data: str, unit: str, key: str, count: int, stats: Any) -> dict[str, Any]:
    """What `test_sequences` read (rows, ``key``: the ``count`` usable, dropped per reason); an error without any."""
    if not count:
        raise DataError(f"--data {data}: no usable {unit} ({stats.rows} read, dropped {dict(stats.dropped)})")
    return {"rows": stats.rows, key: count, "dropped": dict(stats.dropped)}


@dataclass(frozen=True)
class KindPipeline:
    """A batch kind's data: its training data (``train(data_cfg, tokenizer, batching, max_prompt_tokens)``) and the
    sequences of a test file (``test(test_cfg, tokenizer, data)``; None: the kind has no fixed text to score)."""

    train: Callable[[DataConfig, Tokenizer, Batching, int | None], TrainingData]
    test: Callable[[DataConfig, Tokenizer, str], tuple[Any, dict[str, Any]]] | None


# Each batch kind of `jaxtune.config.kinds` and how its data is made (a test holds that every kind has one).
PIPELINES: dict[BatchKind, KindPipeline] = {
    WINDOWS: KindPipeline(_windows, _test_windows),
    ROWS: KindPipeline(_rows, _test_rows),
    PAIRS: KindPipeline(_pairs, _test_pairs),
    UNPAIRED: KindPipeline(_unpaired, _test_unpaired),
    PROMPTS: KindPipeline(_prompts, None),
}


def _block(global_batch: int, process_index: int, process_count: int, start: int = 0) -> range:
    """Process ``process_index``'s rows of a global batch of ``global_batch`` rows starting at ``start``: the
    ``process_index``-th of ``process_count`` equal contiguous blocks."""
    local = global_batch // process_count
    return range(start + process_index * local, start + (process_index + 1) * local)


def _local_batch(global_batch: int, process_index: int, process_count: int, key: str) -> int:
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, process_count={process_count})")
    if global_batch % process_count:
        raise DataError(
            f"{key}={global_batch} does not split over {process_count} processes; make it a multiple of {process_count}"
        )
    return global_batch // process_count


def _shuffle_seed(seed: int) -> int:
    # Grain shuffles epoch e with seed + e, so raw seeds s and s + 1 would replay each other's epochs one
    # epoch apart; hashing the seed first makes different seeds give unrelated orders.
    return int.from_bytes(hashlib.sha256(f"jaxtune-shuffle:{seed}".encode()).digest()[:4], "little")


def _parse_absl_flags() -> None:
    # Grain's worker processes read its absl flags, which raise until parsed; parse defaults unless the
    # program (an absl app) already did.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])
