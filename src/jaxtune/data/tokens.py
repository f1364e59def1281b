"""The corpus tokenized once into a flat, memory-mapped token file, cut into fixed-length windows.

The file ``cache_dir/tokens-<key>.bin`` holds every document's ids followed by ``eos_id`` (and preceded by the
tokenizer's ``bos_prefix`` when it has one: a Llama 3 or Gemma checkpoint's tokenizer puts BOS before every text,
and the model was trained so), as uint16 (vocab ≤ 65536) or uint32; ``tokens-<key>.json`` beside it records the
count and dtype. The key hashes the sources fingerprint and the tokenizer fingerprint (with its BOS), so changing
either re-tokenizes, and nothing else does (``seq_len`` and ``val_fraction`` only change how the file is cut).

Windows have ``seq_len + 1`` tokens with stride ``seq_len``: inputs are ``window[:-1]``, targets
``window[1:]``. Sources are read in a fixed order (the stdlib in path order), so a validation split taken
from one end would sample one corner of the corpus. Instead the stream is cut into periods of
``P = round(1 / val_fraction)`` blocks of ``B`` windows each: ``P - 1`` training blocks, then one
validation block. Each box below is a window's ``seq_len`` inputs; ``·`` is the final target of the
last window of a run, which no window of the other split reads, so no token is shared between the splits::

    |train 0| ... |train R-1|·|val 0| ... |val B-1|·|train R| ... |train 2R-1|·|val B| ...
    |<------ period 0: (R + B)·seq_len + 2 tokens ->|<------ period 1 ...
     R = (P - 1)·B training windows, then B validation windows, in every period

``B`` is 8 (runs of validation windows: fewer of them border training text, and reads stay local), or
less when the corpus holds fewer than 16 periods of 8-window blocks, down to 1, so that a small corpus is
still sampled in many places.
The last, partial period holds the ``w`` windows that fit in what is left: its first ``w - ceil(w / P)``
are training windows, the rest validation. So ``val_windows == ceil((train_windows + val_windows) / P)``,
a share of ``1 / P`` to within one window; ``1 / P`` is ``val_fraction`` exactly when ``1 / val_fraction``
is a whole number (0.1, 0.05, 0.02, 0.01, 0.001), else within a relative ``val_fraction / (2 -
val_fraction)`` (≤ 5.3% for val_fraction ≤ 0.1); above 0.5 is an error. A corpus of ``2·seq_len + 2``
tokens or more has at least one window of each split. The layout leaves out two tokens a period and
less than one window at the end.

Writing the file, in shards a killed run resumes from, is `jaxtune.data.shards`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.config.kinds import PRETOKENIZED_FORMAT
from jaxtune.data import shards, sources
from jaxtune.data.errors import DataError
from jaxtune.data.sources import is_pretokenized, sources_fingerprint
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.io import atomic_file, exclusive, read_json, writable_dir, write_text_atomically

log = logging.getLogger(__name__)

# The cache's layout version, part of every cache key: a new layout, or new rules for what goes into it, takes a new
# number, so no cache made under other rules is read as this one.
_FORMAT = 2
# Windows per validation block, and the fewest periods a corpus is cut into before blocks shrink toward 1.
_MAX_BLOCK = 8
_MIN_PERIODS = 16

Split = Literal["train", "val"]


class _Layout(NamedTuple):
    """Where the windows lie (see the module docstring): per period, ``train_block`` training windows
    (``R``) then ``val_block`` validation windows (``B``); ``train_windows``/``val_windows`` in all."""

    train_block: int
    val_block: int
    train_windows: int
    val_windows: int


@dataclass(frozen=True, eq=False)  # eq/hash by identity: fields hold a large array
class TokenData:
    """A cached token stream (``tokens``: (num_tokens,) memmap) cut into train/val windows by
    ``val_fraction`` as the module docstring draws; ``train_windows``/``val_windows`` count them."""

    tokens: np.ndarray
    seq_len: int
    val_fraction: float
    path: Path
    skipped: dict[str, int] = field(default_factory=dict)  # documents skipped for bad bytes, by reason
    train_windows: int = field(init=False)
    val_windows: int = field(init=False)
    _layout: _Layout = field(init=False, repr=False)

    def __post_init__(self) -> None:
        layout = _cut(len(self.tokens), self.seq_len, self.val_fraction)
        # Derived once here (window() runs per sample); frozen dataclasses allow that only via object.
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "train_windows", layout.train_windows)
        object.__setattr__(self, "val_windows", layout.val_windows)

    def report(self) -> list[str]:
        """What was skipped for bad bytes (``data.bad_rows=drop``), for the start-of-training report."""
        return sources.skip_lines(self.skipped)

    def windows(self, split: Split) -> int:
        return self.train_windows if split == "train" else self.val_windows

    def window(self, index: int, split: Split = "train") -> np.ndarray:
        """Window ``index`` of ``split``: (seq_len + 1,) tokens; inputs ``[:-1]``, targets ``[1:]``."""
        if not 0 <= index < self.windows(split):
            raise IndexError(f"{split} window {index} out of range [0, {self.windows(split)})")
        start = self._start(index, split)
        return self.tokens[start : start + self.seq_len + 1]

    def _start(self, index: int, split: Split) -> int:
        """Offset in ``tokens`` of window ``index`` of ``split`` (not range-checked; ``window`` is)."""
        r, b = self._layout.train_block, self._layout.val_block
        period_tokens = (r + b) * self.seq_len + 2
        if split == "train":
            period, i = divmod(index, r)
            return period * period_tokens + i * self.seq_len
        period, i = divmod(index, b)
        # The validation run follows the period's training run, which is shorter in the last period.
        train_here = min(r, self.train_windows - period * r)
        return period * period_tokens + train_here * self.seq_len + 1 + i * self.seq_len

    def __reduce__(self) -> tuple:
        # Pickle as the file path, not the tokens: Grain sends the data source to its worker processes,
        # and a pickled memmap would copy the whole file.
        return (_reopen, (self.path, self.tokens.dtype.str, len(self.tokens), self.seq_len, self.val_fraction))


def _reopen(path: Path, dtype: str, num_tokens: int, seq_len: int, val_fraction: float) -> TokenData:
    return TokenData(np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,)), seq_len, val_fraction, path)


def prepare_tokens(data_cfg: DataConfig, tokenizer: Tokenizer) -> TokenData:
    """Tokenizes the corpus into the cache (first call only; an interrupted call is resumed) and maps it into
    memory."""
    cache = Path(data_cfg.cache_dir).expanduser()
    bos = list(tokenizer.bos_prefix) if not is_pretokenized(data_cfg) else []
    key_src = json.dumps([sources_fingerprint(data_cfg), tokenizer.fingerprint, _FORMAT, sources.BLOCK_BYTES,
                          *([PRETOKENIZED_FORMAT, data_cfg.token_eos_id] if is_pretokenized(data_cfg) else []),
                          *(["bos", bos] if bos else [])])  # no BOS adds nothing: such a cache keeps its key
    path = cache / f"tokens-{hashlib.sha256(key_src.encode()).hexdigest()[:20]}.bin"
    meta = _read_meta(path)
    if meta is None:
        writable_dir(cache, "data.cache_dir=", Path(data_cfg.cache_dir))
        with _locked(path):  # one writer per cache entry; a second process waits, then reads the finished file
            meta = _read_meta(path, quiet=True) or _write_tokens(path, data_cfg, tokenizer)
    num_tokens = meta["num_tokens"]
    tokens = np.memmap(path, dtype=meta["dtype"], mode="r", shape=(num_tokens,))
    data = TokenData(tokens=tokens, seq_len=data_cfg.seq_len, val_fraction=data_cfg.val_fraction, path=path,
                     skipped=meta.get("skipped", {}))
    if data.train_windows < 1:
        raise DataError(
            f"data.seq_len={data_cfg.seq_len} leaves no training window: the corpus has {num_tokens} tokens "
            f"({data.val_windows} validation window(s) at data.val_fraction={data_cfg.val_fraction}); "
            "add text (data.sources, data.max_bytes) or lower data.seq_len"
        )
    return data


def _cut(num_tokens: int, seq_len: int, val_fraction: float) -> _Layout:
    """The interleaved-block layout of the module docstring for a stream of ``num_tokens`` tokens."""
    total = max(0, (num_tokens - 1) // seq_len)  # windows if there were no validation split
    if val_fraction == 0:
        return _Layout(train_block=max(total, 1), val_block=0, train_windows=total, val_windows=0)
    if val_fraction > 0.5:
        raise DataError(
            f"data.val_fraction={val_fraction} is above 0.5: validation is one block in every "
            "round(1 / val_fraction) ≥ 2 blocks, so at most half the windows; lower data.val_fraction"
        )
    period = round(1 / val_fraction)
    block = min(_MAX_BLOCK, max(1, total // (_MIN_PERIODS * period)))
    train_block = (period - 1) * block
    # Each run of windows needs seq_len * windows + 1 tokens of its own: 2 tokens a period beyond the strides.
    full, rest = divmod(num_tokens, period * block * seq_len + 2)
    fit = max(0, (rest - 2) // seq_len)  # windows in the partial last period, training and validation
    val_rest = -(-fit // period)
    return _Layout(
        train_block=train_block,
        val_block=block,
        train_windows=full * train_block + fit - val_rest,
        val_windows=full * block + val_rest,
    )


def _read_meta(path: Path, quiet: bool = False) -> dict | None:
    """The sidecar of a complete token file, or None: the sidecar is written last, so it marks completion."""
    sidecar = path.with_suffix(".json")
    if not (sidecar.is_file() and path.is_file()):
        return None
    try:  # a damaged sidecar, like a damaged token file, only costs a re-tokenization
        meta = read_json(sidecar, error=DataError)
        size = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    except (DataError, KeyError, TypeError, ValueError) as e:
        reason = e if isinstance(e, DataError) else f"{sidecar}: unreadable ({type(e).__name__}: {e})"
        if not quiet:
            log.warning("%s; re-tokenizing", reason)
        return None
    if path.stat().st_size != size:
        if not quiet:
            log.warning("%s does not match %s; re-tokenizing", path, sidecar.name)
        return None
    return meta


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path``'s shard directory (created for it) while the body runs; the directory
    goes once the token file is complete."""
    shard_dir = path.with_suffix(".shards")
    shard_dir.mkdir(exist_ok=True)
    with exclusive(shard_dir / "lock"):
        try:
            yield
        finally:
            if _read_meta(path, quiet=True) is not None:
                shutil.rmtree(shard_dir, ignore_errors=True)


def _write_tokens(path: Path, data_cfg: DataConfig, tokenizer: Tokenizer) -> dict:
    """Tokenizes ``data.sources`` into shards beside ``path`` (keeping those an interrupted run finished), then
    joins them into ``path`` and writes its sidecar, each atomically. Returns the sidecar."""
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    shard_dir = path.with_suffix(".shards")
    for leftover in [*path.parent.glob(f"{path.name}.tmp-*"), *shard_dir.glob("*.tmp-*")]:
        leftover.unlink(missing_ok=True)  # a killed writer's: we hold the lock, so no live writer owns one
    layout = {"format": _FORMAT, "dtype": dtype.str, "block_bytes": sources.BLOCK_BYTES,
              "task_bytes": shards.TASK_BYTES, "shard_bytes": shards.SHARD_BYTES}
    manifest = shards.Manifest.load(shard_dir, layout)
    if manifest.complete is None:
        shards.write_shards(data_cfg, tokenizer, dtype, path, manifest)
    assert manifest.complete is not None
    meta = {"num_tokens": sum(s["num_tokens"] for s in manifest.shards.values()),
            "num_documents": manifest.complete["documents"], "dtype": dtype.str,
            "tokenizer": tokenizer.fingerprint, "skipped": manifest.complete["skipped"]}
    with atomic_file(path) as out:  # the shards were checked against the manifest when it was loaded
        for index in range(manifest.complete["num_shards"]):
            with (shard_dir / shards.shard_name(index)).open("rb") as f:
                shutil.copyfileobj(f, out, 8 << 20)
    write_text_atomically(path.with_suffix(".json"), json.dumps(meta, indent=2) + "\n")
    return meta
