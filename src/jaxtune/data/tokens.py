"""The corpus tokenized once into a flat, memory-mapped token file, cut into fixed-length windows.

The file ``cache_dir/tokens-<key>.bin`` holds every document's ids followed by ``eos_id``, as uint16
(vocab ≤ 65536) or uint32; ``tokens-<key>.json`` beside it records the count and dtype. The key hashes the
sources fingerprint and the tokenizer fingerprint, so changing either re-tokenizes, and nothing else does
(``seq_len`` and ``val_fraction`` only change how the file is cut).

Windows have ``seq_len + 1`` tokens with stride ``seq_len``: inputs are ``window[:-1]``, targets
``window[1:]``. Training windows start at token 0; the ``val_windows`` validation windows are the tail,
starting one token after the last training target so that no token is shared between the splits::

    |train 0|train 1| ... |train T-1|·|val 0|val 1| ... |val V-1|   (· = one skipped token)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.data.errors import DataError
from jaxtune.data.sources import iter_documents, sources_fingerprint
from jaxtune.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bumped when the file layout changes, so old caches are not misread.
_FORMAT = 1
# Text handed to one encode_batch call: bounds memory while giving the tokenizer enough to parallelise.
_CHUNK_CHARS = 1 << 22

Split = Literal["train", "val"]


@dataclass(frozen=True, eq=False)  # eq/hash by identity: fields hold a large array
class TokenData:
    """A cached token stream (``tokens``: (num_tokens,) memmap) and its train/val window counts."""

    tokens: np.ndarray
    seq_len: int
    train_windows: int
    val_windows: int
    path: Path

    @property
    def val_start(self) -> int:
        """Offset of the first validation window: one past the last training target."""
        return self.train_windows * self.seq_len + 1

    def windows(self, split: Split) -> int:
        return self.train_windows if split == "train" else self.val_windows

    def window(self, index: int, split: Split = "train") -> np.ndarray:
        """Window ``index`` of ``split``: (seq_len + 1,) tokens; inputs ``[:-1]``, targets ``[1:]``."""
        if not 0 <= index < self.windows(split):
            raise IndexError(f"{split} window {index} out of range [0, {self.windows(split)})")
        start = index * self.seq_len + (0 if split == "train" else self.val_start)
        return self.tokens[start : start + self.seq_len + 1]

    def __reduce__(self) -> tuple:
        # Pickle as the file path, not the tokens: Grain sends the data source to its worker processes,
        # and a pickled memmap would copy the whole file.
        fields = (
            self.path,
            self.tokens.dtype.str,
            len(self.tokens),
            self.seq_len,
            self.train_windows,
            self.val_windows,
        )
        return (_reopen, fields)


def _reopen(path: Path, dtype: str, num_tokens: int, seq_len: int, train: int, val: int) -> TokenData:
    return TokenData(np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,)), seq_len, train, val, path)


def prepare_tokens(data_cfg: DataConfig, tokenizer: Tokenizer) -> TokenData:
    """Tokenizes the corpus into the cache (first call only) and maps it into memory."""
    cache = Path(data_cfg.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    key_src = json.dumps([sources_fingerprint(data_cfg), tokenizer.fingerprint, _FORMAT])
    path = cache / f"tokens-{hashlib.sha256(key_src.encode()).hexdigest()[:20]}.bin"
    meta = _read_meta(path)
    if meta is None:
        meta = _write_tokens(path, iter_documents(data_cfg), tokenizer)
    num_tokens = meta["num_tokens"]
    train, val = _split(num_tokens, data_cfg.seq_len, data_cfg.val_fraction)
    if train < 1:
        raise DataError(
            f"data.seq_len={data_cfg.seq_len} leaves no training window: the corpus has {num_tokens} tokens "
            f"({val} validation window(s) at data.val_fraction={data_cfg.val_fraction}); "
            "add text (data.sources, data.max_bytes) or lower data.seq_len"
        )
    tokens = np.memmap(path, dtype=meta["dtype"], mode="r", shape=(num_tokens,))
    return TokenData(tokens=tokens, seq_len=data_cfg.seq_len, train_windows=train, val_windows=val, path=path)


def _split(num_tokens: int, seq_len: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) window counts: val is the ceil(val_fraction) share of all windows, at the end."""
    total = (num_tokens - 1) // seq_len
    val = math.ceil(val_fraction * total)
    if val == 0:
        return total, 0
    # Both splits need seq_len * windows + 1 tokens of their own (see the module docstring).
    train = (num_tokens - 2 - val * seq_len) // seq_len
    return max(train, 0), val


def _read_meta(path: Path) -> dict | None:
    """The sidecar of a complete token file, or None: the sidecar is written last, so it marks completion."""
    sidecar = path.with_suffix(".json")
    if not (sidecar.is_file() and path.is_file()):
        return None
    meta = json.loads(sidecar.read_text())
    if path.stat().st_size != meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize:
        log.warning("%s does not match %s; re-tokenizing", path, sidecar.name)
        return None
    return meta


def _write_tokens(path: Path, docs: Iterable[str], tokenizer: Tokenizer) -> dict:
    """Writes ``path`` and its sidecar atomically (temp name, fsync, rename) and returns the sidecar."""
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    log.info("tokenizing the corpus into %s", path)
    num_tokens = num_docs = 0
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("wb") as f:
            for chunk in _chunks(docs, _CHUNK_CHARS):
                ids = tokenizer.encode_batch(chunk)
                flat = np.concatenate([np.asarray([*doc, tokenizer.eos_id], dtype=dtype) for doc in ids])
                f.write(flat.tobytes())
                num_tokens += len(flat)
                num_docs += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"num_tokens": num_tokens, "num_documents": num_docs, "dtype": dtype.str, "tokenizer": tokenizer.fingerprint}
    _write_text_atomically(path.with_suffix(".json"), json.dumps(meta, indent=2) + "\n")
    log.info("%d documents, %d tokens", num_docs, num_tokens)
    return meta


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _chunks(docs: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
