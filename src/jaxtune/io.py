"""Files, written so that a crash never leaves half of one, and read so that a damaged one says which it is.

Atomic writes (`atomic_file`, `write_text_atomically`, `atomic_dir`): everything is written under a temporary
name beside the target and renamed into place once complete. safetensors (`SafetensorsFile`, `write_safetensors`):
the one weight format jaxtune reads and writes itself, memory-mapped, never pickle. `read_json` names the file and
line of a syntax error. `host` brings an array (sharded over several hosts, too) to this host as numpy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import shutil
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class OutputError(ValueError):
    """An output path the user gave that cannot be written (one line naming it)."""


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read as asked; the message names the file."""


# --- atomic writes ---

def _temp_name(path: Path, tag: str = "tmp") -> Path:
    return path.with_name(f"{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; on success it is flushed, fsynced and renamed to
    ``path``; on failure it is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = _temp_name(path)
    try:
        with tmp.open(mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    with atomic_file(path, "w") as f:
        f.write(text)


# What an export writes (`write_model`, `write_adapter`, transformers' and PEFT's save_pretrained, `Tokenizer.save`):
# ``overwrite`` replaces a directory that holds only these, so it never deletes a file of the user's with it.
EXPORT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "adapter_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "chat_template.jinja", "jaxtune_tokenizer.json")


def describe(code: int) -> str:
    """``No space left on device (ENOSPC)``."""
    return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"


def why_not(path: Path, e: OSError) -> str:
    """Why ``path`` could not be created, as ``e`` says (a part of it that is a file named as such)."""
    blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
    return f"{blocker} is a file, not a directory" if blocker is not None else describe(e.errno) if e.errno else str(e)


def writable_dir(directory: Path, what: str, named: Path | None = None) -> Path:
    """Make ``directory`` and write a probe file in it (removed at once), or raise one `OutputError` naming the path
    the user gave, ``named`` (default ``directory``), after ``what`` (the flag or key it came from), rather than the
    temporary path an atomic write would fail on first."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".jaxtune-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"{what}{named or directory}: cannot write there ({why_not(directory, e)}); choose a place "
                          "you can write") from None
    return directory


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse to write into a non-empty directory unless ``overwrite`` (``--overwrite``), and even then when it holds
    anything but an earlier export's files (`EXPORT_FILES`): the directory is replaced whole."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose a new directory")
    entries = sorted(out.iterdir())
    if entries and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory, or pass --overwrite to "
                              "replace an earlier export there")
    foreign = [e.name + ("/" if e.is_dir() else "") for e in entries
               if e.is_dir() or not any(fnmatch.fnmatchcase(e.name, pattern) for pattern in EXPORT_FILES)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FileExistsError(f"{out} holds files an export does not write ({shown}); --overwrite replaces only an "
                              "earlier export: move them away, or choose a new directory")


@contextlib.contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Holds an exclusive ``flock`` on the file ``lock`` (created) while the body runs: processes of one host that
    would build the same cached thing take turns, and the later ones find it built. The kernel drops the lock when
    its holder dies, however it dies."""
    with Path(lock).open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_dir(out: Path, fill: Callable[[Path], None], *, replace: bool = True) -> bool:
    """``fill(tmp)`` writes a directory beside ``out``, which is then renamed into place, so a failed write leaves
    nothing half-written. ``replace``: an existing ``out`` is replaced only once the new one is complete; else an
    ``out`` that appeared meanwhile (another process won the race) is kept and False is returned."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        if out.exists() and replace:
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
            return True
        try:
            os.replace(tmp, out)
        except OSError:
            if replace or not out.exists():
                raise
            return False
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- reading ---

def read_json(file: Path, error: type[Exception] = CheckpointError) -> Any:
    """A JSON file's content; a syntax error (or bytes that are not UTF-8) is ``error`` naming file:line."""
    file = Path(file)
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{file}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise error(f"{file}: invalid JSON (not UTF-8 text: byte {e.start})") from None


def host(x: Any) -> np.ndarray:
    """An array on this host as numpy; an array sharded over several hosts is gathered first (every host must call
    this together)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


# --- safetensors ---

class SafetensorsFile:
    """One .safetensors file, memory-mapped; ``get(name)`` is a zero-copy (lazy) numpy view."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if n < 2 or 8 + n > size:
                raise CheckpointError(f"{self.path}: not a safetensors file (bad header length); re-download it")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self.start = 8 + n
        for name, e in header.items():
            if e["dtype"] not in _DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}")
            if self.start + e["data_offsets"][1] > size:
                raise CheckpointError(f"{self.path}: truncated (tensor {name} ends past the end of the file)")
        self.entries: dict[str, dict[str, Any]] = header
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self.start else np.zeros(0, np.uint8)

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        a, b = e["data_offsets"]
        return self._map[self.start + a:self.start + b].view(_DTYPES[e["dtype"]]).reshape(e["shape"])


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (C-order) as one safetensors file."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, x in tensors.items():
        if np.dtype(x.dtype) not in _NAMES:
            raise ValueError(f"{name}: dtype {x.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[np.dtype(x.dtype)], "shape": list(x.shape),
                        "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())
