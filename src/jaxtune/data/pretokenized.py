"""Sources that are token ids already, as other trainers leave them: read in chunks, checked, copied into the cache.

Chosen by suffix (``.bin``, ``.npy``) or by ``data.format: tokens`` (then parquet files and ``hf:`` datasets too):

* nanoGPT's ``train.bin``/``val.bin``: raw uint16 ids, no header; its documents are already separated by eos;
* llm.c's ``.bin``: a header of 256 int32 (magic 20240520, version 1 for uint16 ids or 2 for uint32, the id count
  in ``header[2]``), then the ids; documents already separated;
* ``.npy``: a 1-D integer array, used as it is;
* parquet or a HuggingFace dataset (``data.format: tokens``) with an ``input_ids`` column of id lists: each row is
  one document, followed by eos unless it already ends with it.

The ids must come from the run's tokenizer (``tokenizer.kind``/``tokenizer.path``: ``tiktoken``/``gpt2`` for
nanoGPT's and llm.c's GPT-2 files): an id at or above its vocabulary is a `DataError` naming the file and position.
``data.token_vocab_size`` and ``data.token_eos_id`` state what the files assume; a tokenizer that disagrees is an
error before anything is read. Splits: the files of ``data.sources`` are one stream, cut into training and
validation windows by ``data.val_fraction`` like text; a separate ``val.bin`` is scored with ``jaxtune eval RUN
--data val.bin``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.sources import HFDataset, LocalFiles, ReadStats, hf_rows, resolve_sources

LLMC_MAGIC = 20240520
_LLMC_HEADER_INTS = 256
_LLMC_DTYPES = {1: np.uint16, 2: np.uint32}
# Ids copied at a time: memory stays bounded whatever the file's size.
_CHUNK_IDS = 1 << 22
INPUT_IDS = "input_ids"


def read_token_files(data_cfg: DataConfig, vocab_size: int, eos_id: int, stats: ReadStats) -> Iterator[np.ndarray]:
    """The ids of every ``data.sources`` entry in order, in chunks of at most `_CHUNK_IDS`, checked against
    ``vocab_size``."""
    if data_cfg.token_vocab_size is not None and data_cfg.token_vocab_size > vocab_size:
        raise DataError(f"data.token_vocab_size={data_cfg.token_vocab_size} is larger than the tokenizer's vocabulary "
                        f"({vocab_size}); set tokenizer.kind/tokenizer.path to the tokenizer the ids came from")
    if data_cfg.token_eos_id is not None and data_cfg.token_eos_id != eos_id:
        raise DataError(f"data.token_eos_id={data_cfg.token_eos_id} is not the tokenizer's eos id ({eos_id}); set "
                        "tokenizer.kind/tokenizer.path to the tokenizer the ids came from")
    for source in resolve_sources(data_cfg):
        if isinstance(source, LocalFiles):
            for path in source.paths:
                start = stats.done_bytes
                for where, offset, ids in _file_ids(path, eos_id):
                    _check(ids, vocab_size, where, offset)
                    stats.done_bytes = start + min(path.stat().st_size, (offset + len(ids)) * ids.itemsize)
                    yield ids
                stats.done_bytes = start + path.stat().st_size
        elif isinstance(source, HFDataset):
            for where, row in hf_rows(source.name, data_cfg):
                ids = _row_ids(row, where, eos_id)
                _check(ids, vocab_size, where, 0)
                stats.done_bytes += ids.nbytes
                yield ids
        else:
            raise DataError(f"data.sources: {data_cfg.sources} mixes token files with text sources; token files "
                            "(.bin, .npy, data.format: tokens) must be the only sources")


def _file_ids(path: Path, eos_id: int) -> Iterator[tuple[str, int, np.ndarray]]:
    """(where, index of the chunk's first id in the file, ids) for one file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_ids(path, eos_id)
        return
    if suffix == ".npy":
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(f"{path}: not a .npy array ({e})") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(f"{path}: a token .npy must be a 1-D integer array, not {ids.dtype} of shape {ids.shape}")
    else:
        ids = _bin_ids(path)
    for offset in range(0, len(ids), _CHUNK_IDS):
        yield str(path), offset, np.asarray(ids[offset : offset + _CHUNK_IDS])


def _bin_ids(path: Path) -> np.ndarray:
    """A ``.bin``'s ids: llm.c's when it starts with llm.c's header, else nanoGPT's raw uint16."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=_LLMC_HEADER_INTS) if size >= 4 * _LLMC_HEADER_INTS else None
    if header is not None and header[0] == LLMC_MAGIC:
        version, count = int(header[1]), int(header[2])
        if version not in _LLMC_DTYPES:
            raise DataError(f"{path}: llm.c token file version {version}; jaxtune reads versions 1 (uint16) and 2 "
                            "(uint32)")
        dtype = np.dtype(_LLMC_DTYPES[version]).newbyteorder("<")
        expected = 4 * _LLMC_HEADER_INTS + count * dtype.itemsize
        if size != expected:
            raise DataError(f"{path}: llm.c header says {count} tokens ({expected} bytes) but the file has {size} "
                            "bytes; the file is truncated or not an llm.c token file")
        return np.memmap(path, dtype=dtype, mode="r", offset=4 * _LLMC_HEADER_INTS, shape=(count,))
    if size % 2:
        raise DataError(f"{path}: {size} bytes is not a whole number of uint16 ids; a nanoGPT .bin holds uint16 ids "
                        "(an llm.c .bin starts with its header, magic 20240520)")
    return np.memmap(path, dtype="<u2", mode="r", shape=(size // 2,)) if size else np.zeros(0, np.uint16)


def _parquet_ids(path: Path, eos_id: int) -> Iterator[tuple[str, int, np.ndarray]]:
    import pyarrow.parquet as pq  # lazily: slow to import, and only parquet needs it

    parquet = pq.ParquetFile(path)
    if INPUT_IDS not in parquet.schema_arrow.names:
        raise DataError(f"{path}: no column {INPUT_IDS!r} (columns: {parquet.schema_arrow.names}); "
                        "data.format=tokens reads a parquet file's input_ids lists")
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[INPUT_IDS]):
        rows = batch.column(0).to_pylist()
        ids = np.concatenate([_row_ids({INPUT_IDS: r}, f"{path}[row {row + i}]", eos_id)
                              for i, r in enumerate(rows)] or [np.zeros(0, np.int64)])
        yield f"{path}[rows {row}..{row + len(rows) - 1}]", 0, ids
        row += len(rows)


def _row_ids(row: dict, where: str, eos_id: int) -> np.ndarray:
    ids = row.get(INPUT_IDS)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise DataError(f"{where}: {INPUT_IDS!r} must be a list of token ids (got {type(ids).__name__}); "
                        f"data.format=tokens reads rows of {INPUT_IDS}")
    if not ids or ids[-1] != eos_id:
        ids = [*ids, eos_id]
    return np.asarray(ids, dtype=np.int64)


def _check(ids: np.ndarray, vocab_size: int, where: str, offset: int) -> None:
    if not len(ids) or (ids.max() < vocab_size and (ids.dtype.kind == "u" or ids.min() >= 0)):
        return
    bad = np.flatnonzero((ids >= vocab_size) | (ids < 0)) if ids.dtype.kind == "i" else np.flatnonzero(
        ids >= vocab_size)
    if len(bad):
        i = int(bad[0])
        raise DataError(f"{where}: token {offset + i} is id {int(ids[i])}, not below the tokenizer's vocabulary size "
                        f"{vocab_size}; these ids come from another tokenizer: set tokenizer.kind/tokenizer.path to it"
                        f" (data.token_vocab_size states the vocabulary the files assume)")

