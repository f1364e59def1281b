"""Where pretraining text comes from: ``data.sources`` → a deterministic stream of documents, read in blocks.

Each ``data.sources`` entry is one of

* ``python-stdlib``: every ``.py`` file of the running interpreter's standard library (no site-packages),
  sorted by path. It exists on every machine, so a run needs no download.
* ``hf:NAME``: a HuggingFace dataset, streamed (``pip install 'jaxtune[hf]'``).
* ``synthetic:NAME``: fine-tuning rows the package generates (``synthetic:arithmetic``, preference pairs
  ``synthetic:arithmetic-preferences``, prompts with answers ``synthetic:arithmetic-prompts``), for offline
  quickstarts.
* a local file, a glob (``data/**/*.jsonl``) or a directory (read recursively, hidden entries skipped,
  only ``.txt .md .py .jsonl .json .parquet`` files; token files are named directly or by a glob).

Entries are read in order; whitespace-only documents are dropped; ``data.max_bytes`` cuts the stream. How a file
becomes documents (by its suffix), read `BLOCK_BYTES` at a time with longer documents cut into pieces, is
`jaxtune.data.documents`.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from jaxtune.config import DataConfig
from jaxtune.config.hub import hub_unreachable
from jaxtune.data.documents import Piece, ReadStats, file_pieces, is_token_file, split_long, text_of, text_pieces
from jaxtune.data.errors import DataError
from jaxtune.data.synthetic import GENERATOR_FORMATS, GENERATORS

log = logging.getLogger(__name__)

STDLIB = "python-stdlib"
HF_PREFIX = "hf:"
SYNTHETIC_PREFIX = "synthetic:"
# What a directory source reads (not token files: a directory's .bin may be anything); a file named directly, or
# matched by a glob, is read whatever its suffix.
DIRECTORY_SUFFIXES = frozenset({".txt", ".md", ".py", ".jsonl", ".json", ".parquet"})
_NOT_STDLIB = frozenset({"site-packages", "dist-packages"})
# Bytes read at a time, and the longest piece of a document tokenized at once (see `jaxtune.data.documents`). Changing
# it changes the tokens of longer documents, so the token cache's key includes it. Tests shrink it.
BLOCK_BYTES = 1 << 20


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


def skip_lines(skipped: dict[str, int]) -> list[str]:
    """What was skipped (`ReadStats.skipped`), for the start-of-training report (none when nothing was)."""
    if not skipped:
        return []
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    line = f"data.sources: skipped {sum(skipped.values())} document(s) with bad bytes ({reasons}); data.bad_rows=drop"
    return [line]


def iter_documents(data_cfg: DataConfig) -> Iterator[str]:
    """Documents of all ``data.sources`` in order, cut after ``data.max_bytes`` UTF-8 bytes of text, each whole:
    the pieces of `read_pieces` joined (so memory grows with the longest document; the tokenizer reads pieces).

    Raises ``DataError`` for a source that matches nothing, a malformed record, or when nothing came out.
    """
    parts: list[str] = []
    for piece in read_pieces(data_cfg):
        parts.append(piece.text)
        if piece.end:
            yield "".join(parts)
            parts = []


def read_pieces(data_cfg: DataConfig, stats: ReadStats | None = None,
                block_bytes: int | None = None) -> Iterator[Piece]:
    """Every document of ``data.sources`` in order as pieces of at most ``block_bytes`` (default `BLOCK_BYTES`)
    UTF-8 bytes, cut after ``data.max_bytes`` bytes of text (the last document ends there). ``stats`` is updated
    as the sources are read (for progress, and the bad-byte skips).

    Raises ``DataError`` for a source that matches nothing, a malformed record or bad bytes (``data.bad_rows``),
    or when nothing came out.
    """
    block = block_bytes or BLOCK_BYTES
    stats = stats if stats is not None else ReadStats()
    sources = resolve_sources(data_cfg)
    pieces = (p for source in sources for p in _pieces(source, data_cfg, block, stats))
    if data_cfg.max_bytes is not None:
        pieces = take_bytes(pieces, data_cfg.max_bytes)
    produced = False
    for piece in pieces:
        produced = produced or bool(piece.text)
        stats.documents += piece.end
        yield piece
    if not produced:
        raise DataError(
            f"data.sources produced no text: {data_cfg.sources}; "
            "check that the files are not empty and that data.text_field names the text field"
        )


def source_bytes(sources: list[_Source], data_cfg: DataConfig) -> int | None:
    """How many bytes a pass reads: the files' sizes (at most ``data.max_bytes``); None with a HuggingFace dataset
    and no ``data.max_bytes``."""
    total: int | None = 0
    for source in sources:
        if isinstance(source, (_Stdlib, LocalFiles)):
            total = None if total is None else total + sum(p.stat().st_size for p in source.paths)
        else:
            total = None
    if data_cfg.max_bytes is not None:
        return data_cfg.max_bytes if total is None else min(total, data_cfg.max_bytes)
    return total


def take_bytes(pieces: Iterable[Piece], limit: int) -> Iterator[Piece]:
    """The pieces up to ``limit`` UTF-8 bytes of text in total; the last one is cut (at a character boundary) and
    ends its document."""
    remaining = limit
    for piece in pieces:
        size = len(piece.text) if piece.text.isascii() else len(piece.text.encode("utf-8"))
        if size >= remaining:
            head = piece.text.encode("utf-8")[:remaining].decode("utf-8", errors="ignore")
            if head.strip():
                yield Piece(head, end=True)
            return
        remaining -= size
        yield piece


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
            held = GENERATOR_FORMATS[name]
            if held not in data_cfg.row_formats:  # pretraining text included
                unpair = ", or data.unpair=true to read each pair as two unpaired rows" \
                    if data_cfg.unpair_would_read(held) else ""
                raise DataError(f"{key}[{i}]: {entry} holds {held} rows; set data.format={held}{unpair}")
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


def _pieces(source: _Source, data_cfg: DataConfig, block: int, stats: ReadStats) -> Iterator[Piece]:
    match source:
        case _Stdlib(_, paths):
            for path in paths:
                yield from text_pieces(path, block, "replace", stats)
        case LocalFiles(paths):
            for path in paths:
                yield from file_pieces(path, data_cfg, block, stats)
        case HFDataset(name):
            for _, row in hf_rows(name, data_cfg):
                text = text_of(row, data_cfg.text_field, f"{HF_PREFIX}{name}")
                stats.done_bytes += len(text)
                yield from split_long(text, block)
        # Synthetic: never here, as resolve_sources refuses generated rows unless data.format is theirs.


def is_pretokenized(data_cfg: DataConfig) -> bool:
    """Whether ``data.sources`` are token ids (``data.format: tokens``, or ``.bin``/``.npy`` files)."""
    return data_cfg.pretokenized or any(
        isinstance(s, LocalFiles) and all(is_token_file(p, data_cfg) for p in s.paths)
        for s in resolve_sources(data_cfg))


def hf_rows(name: str, data_cfg: DataConfig) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of the HuggingFace dataset ``name`` (``data.hf_config``, ``data.hf_split``),
    streamed."""
    try:
        import datasets  # optional dependency: only hf: sources need it
    except ImportError:
        raise DataError(
            f"data.sources: {HF_PREFIX}{name} needs the HuggingFace datasets library: pip install 'jaxtune[hf]'"
        ) from None
    # One bounded request first: datasets' own retries take ~30 s to give up without network.
    unreachable = hub_unreachable(name, f"data.sources: {HF_PREFIX}{name}", repo_type="dataset")
    offline, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, bool(unreachable) or \
        datasets.config.HF_HUB_OFFLINE
    try:
        rows = datasets.load_dataset(name, data_cfg.hf_config, split=data_cfg.hf_split, streaming=True)
    except Exception as e:  # noqa: BLE001 (not cached, missing, a failed download: one line, with the ways on)
        why = f"{unreachable} and it is not in the datasets cache" if unreachable else " ".join(str(e).split())
        raise DataError(f"data.sources: {HF_PREFIX}{name}: {why}; pass local files (data.sources=[rows.jsonl]), "
                        "or load it once where there is network (then HF_HUB_OFFLINE=1 reads the cache)") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    for i, row in enumerate(rows):
        yield f"{HF_PREFIX}{name}[{data_cfg.hf_split}][{i}]", row
