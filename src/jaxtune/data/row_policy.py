"""What every row-based format (SFT, preference pairs, GRPO prompts) does with its rows besides encoding them, as the
``data.*`` keys say: the good rows of the sources with the bad ones counted per reason (`parsed_rows`, `RowStats`,
`DROP_REASONS`; ``data.bad_rows``), the error for a row over the length limit (``data.overlong=raise``), the
training / held-out split (`split_rows`: ``data.val_sources``, else ``data.val_fraction`` by a hash of the row's
tokens), and the settings of the formats trained on completions (`completion_settings`: ``data.loss_on``,
``data.chat_template``)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jaxtune.config import DataConfig
from jaxtune.data.chat import resolve_chat_template
from jaxtune.data.errors import DataError
from jaxtune.data.formats import REASONS, Example, Pair, Prompt, field_names, parse_row
from jaxtune.data.rows import BadRow, read_rows
from jaxtune.data.tokenizer import Tokenizer

T = TypeVar("T")
# Why a row was dropped: bad rows (data.bad_rows) first, then length (data.overlong) and empty-loss rows.
DROP_REASONS = (*REASONS, "overlong", "no_trainable_tokens")


@dataclass
class RowStats:
    """What reading the rows found: how many were read, dropped (per reason) and truncated (data.overlong)."""

    rows: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    prompts_cut: int = 0  # prompts cut to data.max_prompt_length

    def drop_lines(self, unit: str) -> list[str]:
        """Report lines: the rows dropped per reason (in `DROP_REASONS` order, then a registered format's own
        reasons), the ``unit`` truncated, if any."""
        out = []
        if self.dropped:
            order = [*DROP_REASONS, *(r for r in self.dropped if r not in DROP_REASONS)]
            out.append("dropped rows: " + ", ".join(f"{r} {self.dropped[r]}" for r in order if self.dropped[r]))
        if self.truncated:
            out.append(f"truncated {unit} (data.overlong=truncate): {self.truncated}")
        if self.prompts_cut:
            out.append(f"prompts cut to their last data.max_prompt_length tokens: {self.prompts_cut}")
        return out


def parsed_rows(sources: list[str], data_cfg: DataConfig, stats: RowStats,
                chunk: int = 1024) -> Iterator[list[tuple[str, Example | Pair | Prompt]]]:
    """The good rows of ``sources`` as (where, parsed row), in chunks of up to ``chunk``, counting every row read
    (``stats.rows``) and the bad ones dropped (``stats.dropped``). A bad row under ``data.bad_rows=raise`` raises
    only once the chunk before it is consumed, so an earlier row's error (its length) comes first."""
    fields = field_names(data_cfg)
    pending: list[tuple[str, Example | Pair | Prompt]] = []
    rows = read_rows(sources, data_cfg)
    for where, record in unpaired_records(rows) if data_cfg.unpair else rows:
        stats.rows += 1
        try:
            pending.append((where, parse_row(record, data_cfg, fields)))
        except BadRow as bad:
            if data_cfg.bad_rows == "raise":
                yield pending
                raise DataError(f"{where}: {bad.detail}" + ("" if bad.reason == "wrong_format" else
                                "; fix the row or set data.bad_rows=drop")) from None
            stats.dropped[bad.reason] += 1
        if len(pending) >= chunk:
            yield pending
            pending = []
    yield pending


UNPAIR_BATCH = 1000  # TRL's unpair_preference_dataset maps batches of this many rows (datasets' default)


def unpaired_records(rows: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``data.unpair``: each preference pair {prompt, chosen, rejected} as two unpaired rows, its chosen completion
    labelled true and its rejected one false, other fields kept on both; any other row as it is. In TRL's order
    (``unpair_preference_dataset``, a batched map): per batch of `UNPAIR_BATCH` rows, the chosen halves, then the
    rejected ones; so the KL rows (each row's prompt with the previous row's completion) mismatch prompts as TRL's do,
    where interleaving would pair a rejected row's prompt with its own chosen completion."""
    batch: list[tuple[str, Any]] = []
    for item in rows:
        batch.append(item)
        if len(batch) == UNPAIR_BATCH:
            yield from _halves(batch)
            batch = []
    yield from _halves(batch)


def _halves(batch: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    later = []
    for where, record in batch:
        if not isinstance(record, dict) or not {"chosen", "rejected"} <= record.keys() or "completion" in record:
            yield where, record
            continue
        rest = {k: v for k, v in record.items() if k not in ("chosen", "rejected")}
        yield where, {**rest, "completion": record["chosen"], "label": True}
        later.append((where, {**rest, "completion": record["rejected"], "label": False}))
    yield from later


def completion_settings(data_cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """For formats trained on completions (preference pairs, GRPO's prompts): refuses another ``data.loss_on``, and
    sets the chat template (``data.chat_template``) when one is given: text rows need
    none, so its absence is an error only at the first conversational row."""
    if data_cfg.loss_on != "assistant":
        raise DataError(f"data.loss_on={data_cfg.loss_on} does not apply to data.format={data_cfg.format}: the loss is "
                        "on the completions' tokens; leave data.loss_on at assistant")
    if data_cfg.chat_template is not None:
        resolve_chat_template(data_cfg, tokenizer)


def overlong_error(where: str, tokens: int, limit: int, limit_name: str = "data.seq_len + 1",
                   remedy: str = "raise data.seq_len") -> DataError:
    """``data.overlong=raise``: the row at ``where`` has more than ``limit`` tokens (``limit_name``: what sets the
    limit; ``remedy``: how else to make room)."""
    return DataError(f"{where}: {tokens} tokens, more than {limit_name} = {limit}; set data.overlong=truncate or "
                     f"drop, or {remedy}")


def split_rows(data_cfg: DataConfig, load: Callable[[list[str]], list[T]], tokens: Callable[[T], bytes],
               stats: RowStats, unit: str = "rows") -> tuple[list[T], list[T]]:
    """(training, held-out) rows, in order: those ``load`` gives of ``data.sources``, and of ``data.val_sources``
    when set, else ``data.val_fraction`` of the former by a hash of their ``tokens`` (so identical rows always
    land in the same split). No training row is an error, which says what was dropped (``stats``)."""
    rows = load(data_cfg.sources)
    if data_cfg.val_sources:
        train, val = rows, load(data_cfg.val_sources)
    else:
        hashes = (hashlib.sha256(tokens(r)).digest()[:8] for r in rows)
        split = [int.from_bytes(h, "little") / 2**64 < data_cfg.val_fraction for h in hashes]
        train = [r for r, v in zip(rows, split) if not v]
        val = [r for r, v in zip(rows, split) if v]
    if not train:
        raise DataError(f"data.sources hold no usable training {unit} ({stats.rows} read; dropped: "
                        f"{dict(stats.dropped) or 'none'}); check data.format and data.fields")
    return train, val
