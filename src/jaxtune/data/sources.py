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

How a file becomes documents depends on its suffix:

* ``.jsonl`` (and ``.json`` that is not a top-level array): one JSON object per line, text in ``data.text_field``;
* ``.json`` starting with ``[``: an array of such objects, parsed one element at a time;
* ``.parquet``: the string column ``data.text_field``, one record batch at a time;
* ``.bin``/``.npy`` (or any file under ``data.format: tokens``): token ids, not text (`jaxtune.data.pretokenized`);
* anything else is UTF-8 text: the whole file is one document, unless it contains the literal ``<|endoftext|>``,
  which separates documents (the GPT-2 / TinyStories convention); whitespace next to a separator is dropped.
  A NUL byte or bytes that are not UTF-8 are a `DataError` naming the file and byte offset; under
  ``data.bad_rows=drop`` that document is skipped instead, counted and reported. (The ``python-stdlib`` source
  keeps its few Latin-1 test files, their bad bytes replaced: it is the interpreter's own text, not user data.)

Entries are read in order; whitespace-only documents are dropped; ``data.max_bytes`` cuts the stream.

**Blocks.** Files are read ``block_bytes`` (`BLOCK_BYTES`, 1 MiB) at a time, so memory does not grow with the
file or with one document. A document longer than a block is cut into pieces of at most a block: after the last
newline in the second half of the block, else before the last space there (so the space stays with the word it
precedes, as byte-level BPE pre-tokenizers group it), else at a character boundary. Each piece is tokenized on its
own and the document's eos follows its last piece. A byte-level BPE (GPT-2 style, tiktoken) never merges across its
pre-tokenizer's word boundaries, so only the word that straddles a cut can tokenize differently from the whole
document: at a newline cut nothing changes unless the newline is followed by more whitespace; at a space cut the
word is unchanged; at a character cut the word is split in two. Documents of at most a block are tokenized whole,
exactly as before.
"""

from __future__ import annotations

import codecs
import functools
import glob
import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.synthetic import GENERATOR_FORMATS, GENERATORS

log = logging.getLogger(__name__)

STDLIB = "python-stdlib"
HF_PREFIX = "hf:"
SYNTHETIC_PREFIX = "synthetic:"
# Document separator inside plain-text files (GPT-2's end-of-text spelling, used by TinyStories' .txt).
TEXT_SEPARATOR = "<|endoftext|>"
_SEPARATOR = TEXT_SEPARATOR.encode()
# Files of token ids rather than text (`jaxtune.data.pretokenized`).
TOKEN_SUFFIXES = frozenset({".bin", ".npy"})
# What a directory source reads (not token files: a directory's .bin may be anything); a file named directly, or
# matched by a glob, is read whatever its suffix.
DIRECTORY_SUFFIXES = frozenset({".txt", ".md", ".py", ".jsonl", ".json", ".parquet"})
_NOT_STDLIB = frozenset({"site-packages", "dist-packages"})
# Bytes read at a time, and the longest piece of a document tokenized at once (see the module docstring). Changing
# it changes the tokens of longer documents, so the token cache's key includes it. Tests shrink it.
BLOCK_BYTES = 1 << 20
# A skipped document is named in a warning up to this many times per reason; the rest are only counted.
_NAMED_SKIPS = 5


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


@dataclass(frozen=True, slots=True)
class Piece:
    """A document, or one piece of a document longer than a block; ``end``: its last piece (an eos follows)."""

    text: str
    end: bool


@dataclass
class ReadStats:
    """What a `read_pieces` pass has read so far: ``done_bytes`` (of `source_bytes`), documents, and the documents
    skipped under ``data.bad_rows=drop`` by reason."""

    done_bytes: int = 0
    documents: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= _NAMED_SKIPS:
            print(f"skipped {where}: {detail} (data.bad_rows=drop)", file=sys.stderr)



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


def _pieces(source: _Source, data_cfg: DataConfig, block: int, stats: ReadStats) -> Iterator[Piece]:
    match source:
        case _Stdlib(_, paths):
            for path in paths:
                yield from _text_pieces(path, block, "replace", stats)
        case LocalFiles(paths):
            for path in paths:
                yield from _file_pieces(path, data_cfg, block, stats)
        case HFDataset(name):
            for _, row in hf_rows(name, data_cfg):
                text = _text_of(row, data_cfg.text_field, f"{HF_PREFIX}{name}")
                stats.done_bytes += len(text)
                yield from _split_long(text, block)
        # Synthetic: never here, as resolve_sources refuses generated rows unless data.format is theirs.


def _file_pieces(path: Path, data_cfg: DataConfig, block: int, stats: ReadStats) -> Iterator[Piece]:
    suffix = path.suffix.lower()
    if is_token_file(path, data_cfg):
        raise DataError(f"data.sources: {path} holds token ids, not text; token files and text cannot be mixed in "
                        "one run: list only token files (and set tokenizer.kind/path to the tokenizer they came from)")
    start = stats.done_bytes
    if suffix == ".parquet":
        docs: Iterable[str] = _parquet_documents(path, data_cfg.text_field, stats)
    elif suffix in (".jsonl", ".json"):
        docs = _json_documents(path, data_cfg.text_field, block, stats, data_cfg.bad_rows)
    else:
        yield from _text_pieces(path, block, data_cfg.bad_rows, stats)
        return
    for doc in docs:
        yield from _split_long(doc, block)
    stats.done_bytes = start + path.stat().st_size


def is_token_file(path: Path, data_cfg: DataConfig) -> bool:
    """Whether ``path`` holds token ids: a ``.bin``/``.npy`` file, or any file under ``data.format: tokens``."""
    return data_cfg.pretokenized or path.suffix.lower() in TOKEN_SUFFIXES


def _text_pieces(path: Path, block: int, bad_bytes: str, stats: ReadStats) -> Iterator[Piece]:
    """A text file's documents, split on `TEXT_SEPARATOR` as the file streams past in blocks; a document longer
    than ``block`` bytes is cut into pieces (module docstring). ``bad_bytes``: ``raise``, ``drop`` (skip the
    document holding them) or ``replace`` (U+FFFD; the stdlib's few Latin-1 files).

    The buffer holds at most ``2 * block + len(separator)`` bytes: a document is either complete within its
    first block (a separator found) or cut there."""
    start = stats.done_bytes
    with path.open("rb") as f:
        buf, pos, base = b"", 0, 0  # buf[pos:] is unread; base: file offset of buf[0]
        eof = False
        after_separator = False  # the current document follows a separator: its leading whitespace goes
        started = False  # some of the current document was already yielded (it is longer than a block)
        dropped = False  # the current document had bad bytes (data.bad_rows=drop): the rest of it is skipped too
        while True:
            found = buf.find(_SEPARATOR, pos)
            if found != -1 and found - pos <= block:
                end, nxt = found, found + len(_SEPARATOR)
            elif len(buf) - pos > block and (eof or found != -1 or len(buf) - pos >= block + len(_SEPARATOR)):
                end = nxt = pos + _cut_point(buf, pos, block)  # no separator starts within a block: cut
            elif eof:
                end = nxt = len(buf)
            else:
                chunk = f.read(block)
                eof = not chunk
                buf, base, pos = buf[pos:] + chunk, base + pos, 0
                stats.done_bytes = start + base
                continue
            last = end == nxt == len(buf) or nxt != end  # the document ends: at a separator or at the file's end
            if not dropped:
                text = _decode(buf, pos, end, base, path, bad_bytes, stats)
                if text is None:
                    dropped = True
                    if started:  # what was yielded stays, and its eos closes it
                        yield Piece("", end=True)
                else:
                    if after_separator and not started:
                        text = text.lstrip()
                    if nxt != end:  # a separator follows
                        text = text.rstrip()
                    if started or not last or text.strip():
                        yield Piece(text, end=last)
                    started = not last
            if last:
                if nxt == len(buf) and eof:
                    break
                after_separator, started, dropped = True, False, False
            pos = nxt
    stats.done_bytes = start + path.stat().st_size


def _decode(buf: bytes, a: int, b: int, base: int, path: Path, bad_bytes: str, stats: ReadStats) -> str | None:
    """``buf[a:b]`` as text; bad bytes raise, or (drop) are counted and give None."""
    nul = buf.find(b"\0", a, b)
    if nul != -1 and bad_bytes != "replace":
        reason, detail = "nul_bytes", f"byte {base + nul}: a NUL byte (binary data, not text)"
    else:
        try:
            return buf[a:b].decode("utf-8", errors="strict" if bad_bytes != "replace" else "replace")
        except UnicodeDecodeError as e:
            reason, detail = "non_utf8", f"byte {base + a + e.start}: not valid UTF-8 ({e.reason})"
    if bad_bytes == "raise":
        raise DataError(f"{path}: {detail}; re-encode the file as UTF-8 (iconv -f latin1 -t utf-8) or remove it, or "
                        "set data.bad_rows=drop to skip documents with bad bytes")
    stats.skip(reason, str(path), detail)
    return None


def _cut_point(data: bytes, pos: int, limit: int) -> int:
    """Where to cut the document at ``data[pos:]``, which has more than ``limit`` bytes left, as an offset from
    ``pos`` in ``[1, limit]`` (module docstring): after the last newline in the second half of the next ``limit``
    bytes, else before the last space there, else at the last character boundary."""
    half = pos + limit // 2
    newline = data.rfind(b"\n", half, pos + limit)
    if newline != -1:
        return newline + 1 - pos
    space = data.rfind(b" ", half, pos + limit)
    if space > pos:
        return space - pos
    cut = limit
    while cut > 1 and data[pos + cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: not a character boundary
        cut -= 1
    return cut


def _split_long(text: str, block: int) -> Iterator[Piece]:
    """``text`` as one piece, or cut into pieces of at most ``block`` bytes when longer (a JSON or parquet record)."""
    if len(text) * 4 <= block or len(text.encode("utf-8")) <= block:
        if text.strip():
            yield Piece(text, end=True)
        return
    data = text.encode("utf-8")
    pos = 0
    while len(data) - pos > block:
        cut = pos + _cut_point(data, pos, block)
        yield Piece(data[pos:cut].decode("utf-8"), end=False)
        pos = cut
    yield Piece(data[pos:].decode("utf-8"), end=True)


def _json_documents(path: Path, text_field: str, block: int, stats: ReadStats, bad_bytes: str) -> Iterator[str]:
    """The text of every record of a JSONL file, or of a ``.json`` array (parsed one element at a time)."""
    with path.open("rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf")
        if path.suffix.lower() == ".json" and head.lstrip()[:1] == b"[":
            f.seek(0)
            yield from _json_array(f, path, text_field, block)
            return
        f.seek(0)
        for lineno, line in enumerate(f, 1):
            stats.done_bytes += len(line)
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                detail = f"not valid UTF-8 (byte {e.start} of the line)"
                if bad_bytes == "raise":
                    raise DataError(f"{path}:{lineno}: {detail}; re-encode the file as UTF-8, or set "
                                    "data.bad_rows=drop to skip such rows") from None
                stats.skip("non_utf8", f"{path}:{lineno}", detail)
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            yield _text_of(record, text_field, f"{path}:{lineno}")


def _json_array(f, path: Path, text_field: str, block: int) -> Iterator[str]:
    """The elements' text of the JSON array in ``f``, decoded one element at a time: memory holds the largest
    element and a block, not the file."""
    decoder = json.JSONDecoder()
    text, pos, lines_before, eof = "", 0, 0, False
    utf8 = codecs.getincrementaldecoder("utf-8")()

    def more() -> bool:
        nonlocal text, pos, lines_before, eof
        raw = f.read(max(block, len(text) - pos))  # doubling: a large element is not re-parsed once per block
        try:
            chunk = utf8.decode(raw, final=not raw)
        except UnicodeDecodeError:
            raise DataError(f"{path}: not valid UTF-8 near byte {f.tell() - len(raw)}; re-encode the file as "
                            "UTF-8") from None
        lines_before += text.count("\n", 0, pos)
        text, pos, eof = (text[pos:] + chunk).removeprefix("\ufeff"), 0, not raw  # no BOM within a file
        return bool(raw)

    def skip_space() -> str:
        nonlocal pos
        while True:
            while pos < len(text) and text[pos] in " \t\r\n":
                pos += 1
            if pos < len(text) or not more():
                return text[pos : pos + 1]

    def error(msg: str, at: int) -> DataError:
        return DataError(f"{path}:{lines_before + text.count(chr(10), 0, at) + 1}: not valid JSON ({msg})")

    skip_space()
    pos += 1  # the "["
    index = 0
    if skip_space() == "]":
        return
    while True:
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if more():
                continue
            raise error(e.msg, e.pos) from None
        pos = end
        yield _text_of(record, text_field, f"{path}[{index}]")
        index += 1
        after = skip_space()
        if after == "]":
            return
        if after != ",":
            raise error("expected ',' or ']' between array elements", pos)
        pos += 1
        skip_space()


def _parquet_documents(path: Path, text_field: str, stats: ReadStats) -> Iterator[str]:
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
    start, size, rows, done = stats.done_bytes, path.stat().st_size, max(parquet.metadata.num_rows, 1), 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        done += batch.num_rows
        stats.done_bytes = start + size * done // rows
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


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
