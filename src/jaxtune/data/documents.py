"""One file's documents, read in bounded pieces: the readers `jaxtune.data.sources` runs on each local file, and
the `Piece`s and `ReadStats` they yield and update.

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

**Blocks.** Files are read ``block`` bytes (`jaxtune.data.sources.BLOCK_BYTES`, 1 MiB) at a time, so memory does not
grow with the file or with one document. A document longer than a block is cut into pieces of at most a block: after
the last newline in the second half of the block, else before the last space there (so the space stays with the word
it precedes, as byte-level BPE pre-tokenizers group it), else at a character boundary. Each piece is tokenized on
its own and the document's eos follows its last piece. A byte-level BPE (GPT-2 style, tiktoken) never merges across
its pre-tokenizer's word boundaries, so only the word that straddles a cut can tokenize differently from the whole
document: at a newline cut nothing changes unless the newline is followed by more whitespace; at a space cut the
word is unchanged; at a character cut the word is split in two. Documents of at most a block are tokenized whole.
"""

from __future__ import annotations

import codecs
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError

# Document separator inside plain-text files (GPT-2's end-of-text spelling, used by TinyStories' .txt).
TEXT_SEPARATOR = "<|endoftext|>"
_SEPARATOR = TEXT_SEPARATOR.encode()
# Files of token ids rather than text (`jaxtune.data.pretokenized`).
TOKEN_SUFFIXES = frozenset({".bin", ".npy"})
# A skipped document is named in a warning up to this many times per reason; the rest are only counted.
_NAMED_SKIPS = 5


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


def file_pieces(path: Path, data_cfg: DataConfig, block: int, stats: ReadStats) -> Iterator[Piece]:
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
        yield from text_pieces(path, block, data_cfg.bad_rows, stats)
        return
    for doc in docs:
        yield from split_long(doc, block)
    stats.done_bytes = start + path.stat().st_size


def is_token_file(path: Path, data_cfg: DataConfig) -> bool:
    """Whether ``path`` holds token ids: a ``.bin``/``.npy`` file, or any file under ``data.format: tokens``."""
    return data_cfg.pretokenized or path.suffix.lower() in TOKEN_SUFFIXES


def text_pieces(path: Path, block: int, bad_bytes: str, stats: ReadStats) -> Iterator[Piece]:
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


def split_long(text: str, block: int) -> Iterator[Piece]:
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
            yield text_of(record, text_field, f"{path}:{lineno}")


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
        yield text_of(record, text_field, f"{path}[{index}]")
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


def text_of(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where}: no {text_field!r} field (found {keys}); set data.text_field to the field holding the text"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text
