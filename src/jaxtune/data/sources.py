"""Where pretraining text comes from: ``data.sources`` → a deterministic stream of documents (``str``).

Each ``data.sources`` entry is one of

* ``python-stdlib``: every ``.py`` file of the running interpreter's standard library (no site-packages),
  sorted by path. It exists on every machine, so a run needs no download.
* ``hf:NAME``: a HuggingFace dataset, streamed (``pip install 'jaxtune[hf]'``).
* ``synthetic:NAME``: fine-tuning rows the package generates (``synthetic:arithmetic``, preference pairs
  ``synthetic:arithmetic-preferences``, prompts with answers ``synthetic:arithmetic-prompts``), for offline
  quickstarts.
* a local file, a glob (``data/**/*.jsonl``) or a directory (read recursively, hidden entries skipped,
  only ``.txt .md .py .jsonl .json .parquet`` files).

How a file becomes documents depends on its suffix:

* ``.jsonl`` (and ``.json`` that is not a top-level array): one JSON object per line, text in ``data.text_field``;
* ``.json`` starting with ``[``: an array of such objects;
* ``.parquet``: the string column ``data.text_field``;
* anything else is UTF-8 text (undecodable bytes replaced): the whole file is one document, unless it
  contains the literal ``<|endoftext|>``, which separates documents (the GPT-2 / TinyStories convention).

Entries are read in order; whitespace-only documents are dropped; ``data.max_bytes`` cuts the stream.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.synthetic import GENERATOR_FORMATS, GENERATORS

STDLIB = "python-stdlib"
HF_PREFIX = "hf:"
SYNTHETIC_PREFIX = "synthetic:"
# Document separator inside plain-text files (GPT-2's end-of-text spelling, used by TinyStories' .txt).
TEXT_SEPARATOR = "<|endoftext|>"
# What a directory source reads; a file named directly, or matched by a glob, is read whatever its suffix.
DIRECTORY_SUFFIXES = frozenset({".txt", ".md", ".py", ".jsonl", ".json", ".parquet"})
_NOT_STDLIB = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class _Stdlib:
    root: Path
    paths: tuple[Path, ...]


@dataclass(frozen=True)
class LocalFiles:
    paths: tuple[Path, ...]


@dataclass(frozen=True)
class HFDataset:
    name: str


@dataclass(frozen=True)
class Synthetic:
    """Rows the package generates (`jaxtune.data.synthetic`), so a fine-tuning run needs no download."""

    name: str


_Source = _Stdlib | LocalFiles | HFDataset | Synthetic


def iter_documents(data_cfg: DataConfig) -> Iterator[str]:
    """Documents of all ``data.sources`` in order, cut after ``data.max_bytes`` UTF-8 bytes of text.

    Raises ``DataError`` for a source that matches nothing, a malformed record, or when nothing came out.
    """
    docs = (doc for source in resolve_sources(data_cfg) for doc in _documents(source, data_cfg) if doc.strip())
    if data_cfg.max_bytes is not None:
        docs = take_bytes(docs, data_cfg.max_bytes)
    produced = False
    for doc in docs:
        produced = True
        yield doc
    if not produced:
        raise DataError(
            f"data.sources produced no text: {data_cfg.sources}; "
            "check that the files are not empty and that data.text_field names the text field"
        )


def take_bytes(docs: Iterable[str], limit: int) -> Iterator[str]:
    """The documents up to ``limit`` UTF-8 bytes in total; the last one is cut (at a character boundary)."""
    remaining = limit
    for doc in docs:
        size = len(doc.encode("utf-8"))
        if size >= remaining:
            head = doc.encode("utf-8")[:remaining].decode("utf-8", errors="ignore")
            if head.strip():
                yield head
            return
        remaining -= size
        yield doc


def sources_fingerprint(data_cfg: DataConfig) -> str:
    """A hash that changes when the text ``iter_documents`` would produce may change (hex sha256).

    Local files count by path, size and mtime; the stdlib by Python version, location and file sizes
    (mtimes differ between otherwise identical installs); HF datasets by name, config and split.
    """
    h = hashlib.sha256()
    h.update(json.dumps([data_cfg.text_field, data_cfg.max_bytes]).encode())
    for source in resolve_sources(data_cfg):
        match source:
            case _Stdlib(root, paths):
                h.update(f"stdlib\0{sys.version}\0{root}\n".encode())
                for p in paths:
                    h.update(f"{p.relative_to(root)}\0{p.stat().st_size}\n".encode())
            case LocalFiles(paths):
                for p in paths:
                    st = p.stat()
                    h.update(f"file\0{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            case HFDataset(name):
                h.update(json.dumps(["hf", name, data_cfg.hf_config, data_cfg.hf_split]).encode())
            case Synthetic(name):
                h.update(json.dumps(["synthetic", name]).encode())
    return h.hexdigest()


def resolve_sources(data_cfg: DataConfig, entries: list[str] | None = None) -> list[_Source]:
    """What each of ``entries`` (default ``data.sources``) names: the stdlib, local files, or a HF dataset."""
    key = "data.sources" if entries is None or entries is data_cfg.sources else "data.val_sources"
    sources: list[_Source] = []
    for i, entry in enumerate(data_cfg.sources if entries is None else entries):
        if entry == STDLIB:
            sources.append(_stdlib())
        elif entry.startswith(HF_PREFIX):
            sources.append(HFDataset(entry[len(HF_PREFIX) :]))
        elif entry.startswith(SYNTHETIC_PREFIX):
            name = entry[len(SYNTHETIC_PREFIX):]
            if name not in GENERATORS:
                raise DataError(f"{key}[{i}]: unknown generated data {entry!r}; available: "
                                f"{[SYNTHETIC_PREFIX + n for n in GENERATORS]}")
            if GENERATOR_FORMATS[name] != data_cfg.format:  # pretraining text included
                raise DataError(f"{key}[{i}]: {entry} holds {GENERATOR_FORMATS[name]} rows; set "
                                f"data.format={GENERATOR_FORMATS[name]}")
            sources.append(Synthetic(name))
        else:
            sources.append(LocalFiles(_local_paths(entry, key=f"{key}[{i}]")))
    return sources


@functools.cache  # the running interpreter's stdlib does not change while it runs
def _stdlib() -> _Stdlib:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _NOT_STDLIB and d != "__pycache__"]
        paths.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return _Stdlib(root, tuple(sorted(paths)))


def _local_paths(entry: str, key: str) -> tuple[Path, ...]:
    path = Path(entry).expanduser()
    if path.is_file():
        return (path,)
    if path.is_dir():
        found = _walk(path)
        if not found:
            raise DataError(
                f"{key}: directory {entry} has no {'/'.join(sorted(DIRECTORY_SUFFIXES))} files; "
                "point it at the data files or a glob"
            )
        return found
    if any(c in entry for c in "*?["):
        matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
        found = tuple(p for m in matches for p in ((m,) if m.is_file() else _walk(m)))
        if found:
            return found
    raise DataError(f"{key}: no such file or directory: {entry}; give a file, a glob or a directory")


def _walk(directory: Path) -> tuple[Path, ...]:
    """Data files under ``directory``, sorted by path; hidden files and folders (.git, .cache) skipped."""
    found = (
        p
        for p in directory.rglob("*")
        if p.suffix.lower() in DIRECTORY_SUFFIXES
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )
    return tuple(sorted(found))


def _documents(source: _Source, data_cfg: DataConfig) -> Iterator[str]:
    match source:
        case _Stdlib(_, paths) | LocalFiles(paths):
            for path in paths:
                yield from _file_documents(path, data_cfg.text_field)
        case HFDataset(name):
            yield from _hf_documents(name, data_cfg)
        # Synthetic: never here, as resolve_sources refuses generated rows unless data.format is theirs.


def _file_documents(path: Path, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_documents(path, text_field)
    elif suffix in (".jsonl", ".json"):
        yield from _json_documents(path, text_field)
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        if TEXT_SEPARATOR in text:
            yield from (piece.strip() for piece in text.split(TEXT_SEPARATOR))
        else:
            yield text


def _json_documents(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8", errors="replace") as f:
        first = f.read(4096).lstrip()[:1]
        f.seek(0)
        if path.suffix.lower() == ".json" and first == "[":
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            for i, record in enumerate(records):
                yield _text_of(record, text_field, f"{path}[{i}]")
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            yield _text_of(record, text_field, f"{path}:{lineno}")


def _text_of(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where}: no {text_field!r} field (found {keys}); set data.text_field to the field holding the text"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa  # lazily: pyarrow is slow to import and only parquet needs it
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{path}: no column {text_field!r} (columns: {schema.names}); set data.text_field to the text column"
        )
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise DataError(f"{path}: column {text_field!r} has type {column_type}, not string")
    # Record batches keep memory bounded for large files; null rows are skipped like empty documents.
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def _hf_documents(name: str, data_cfg: DataConfig) -> Iterator[str]:
    for where, row in hf_rows(name, data_cfg):
        yield _text_of(row, data_cfg.text_field, where)


def hf_rows(name: str, data_cfg: DataConfig) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of the HuggingFace dataset ``name`` (``data.hf_config``, ``data.hf_split``),
    streamed."""
    try:
        import datasets  # optional dependency: only hf: sources need it
    except ImportError:
        raise DataError(
            f"data.sources: {HF_PREFIX}{name} needs the HuggingFace datasets library: pip install 'jaxtune[hf]'"
        ) from None
    rows = datasets.load_dataset(name, data_cfg.hf_config, split=data_cfg.hf_split, streaming=True)
    for i, row in enumerate(rows):
        yield f"{HF_PREFIX}{name}[{data_cfg.hf_split}][{i}]", row
