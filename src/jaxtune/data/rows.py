"""Fine-tuning rows as read: ``data.sources`` → (where, record), before any format is applied.

A record is what one row holds: a JSON object from a JSONL line, a ``.json`` array or a parquet row, a
HuggingFace dataset row, or a generated (``synthetic:``) row. ``where`` names it for errors (``file:line``,
``file[i]``, ``hf:NAME[split][i]``). A JSONL line that is not valid UTF-8 or not JSON is not an error here: its
record is a `BadRow`, which ``data.bad_rows`` then raises or counts like any other bad row (`jaxtune.data.formats`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.sources import SYNTHETIC_PREFIX, HFDataset, LocalFiles, Synthetic, hf_rows, resolve_sources
from jaxtune.data.synthetic import GENERATORS

# Why a row could not be read at all (the formats add why a readable row is not one of theirs).
READ_REASONS = ("non_utf8", "invalid_json")


class BadRow(Exception):
    """A row that is not usable: ``reason`` counts it (``data.bad_rows=drop``), ``detail`` says what is wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def read_rows(sources: list[str], data_cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    """(where, record) for every row of ``sources``; record is a `BadRow` when it cannot be read."""
    for source in resolve_sources(data_cfg, sources):
        if isinstance(source, LocalFiles):
            for path in source.paths:
                yield from file_rows(path)
        elif isinstance(source, HFDataset):
            yield from hf_rows(source.name, data_cfg)
        elif isinstance(source, Synthetic):
            for i, record in enumerate(GENERATORS[source.name]()):
                yield f"{SYNTHETIC_PREFIX}{source.name}[{i}]", record
        else:
            raise DataError("data.sources: python-stdlib is source code, not fine-tuning data; "
                            f"give JSONL/JSON/parquet files of {data_cfg.format} rows")


def file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for every row of one JSONL, JSON (an array) or parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}[row {i}]", record
        return
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows tools) is not row 1
    if suffix == ".json" and raw.lstrip()[:1] == b"[":
        try:
            records = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{path}: not a valid UTF-8 JSON array ({e}); use JSONL to skip bad rows") from None
        for i, record in enumerate(records):
            yield f"{path}[{i}]", record
        return
    for lineno, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield where, BadRow("non_utf8", f"not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8")
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as e:
            yield where, BadRow("invalid_json", f"not valid JSON ({e.msg} at column {e.colno}); each line must be "
                                "one JSON object")
