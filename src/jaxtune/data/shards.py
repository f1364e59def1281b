"""Writing the token cache (`jaxtune.data.tokens`) in shards, resumably: ``data.sources`` (or token files) cut into
shards of about `SHARD_BYTES` of text, each tokenized in tasks of about `TASK_BYTES`, in order, in-process or by
``data.num_proc`` worker processes (`jaxtune.data.encode_worker`).

The shards lie in the directory ``tokens-<key>.shards`` beside the token file, as ``00000.bin``, ``00001.bin``, ...,
with ``manifest.json`` (`Manifest`): a shard is renamed into place and recorded there once it is whole, so a killed
run leaves only finished shards, and the next run, which cuts the same shards from the same sources, keeps those
that still match their record and writes the rest. `jaxtune.data.tokens` joins the shards into the token file.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.config import DataConfig
from jaxtune.data import encode_worker, sources
from jaxtune.data.encode_worker import encode_pieces
from jaxtune.data.pretokenized import read_token_files
from jaxtune.data.progress import Progress
from jaxtune.data.tokenizer import Tokenizer
from jaxtune.io import write_text_atomically

# Text per task (one encode call, in a worker or in-process): bounds a worker's memory (the text and its encodings,
# some tens of MB) while making the round trip to it cheap. Tests shrink it.
TASK_BYTES = 1 << 20
# Text (or, for token files, id bytes) per shard of the cache: the most an interrupted run loses, and what a resumed
# run skips at a time. Tests shrink it.
SHARD_BYTES = 64 << 20


def write_shards(data_cfg: DataConfig, tokenizer: Tokenizer, dtype: np.dtype, path: Path, manifest: Manifest) -> None:
    """Writes every shard the manifest lacks, in order, then marks it complete."""
    stats = sources.ReadStats()
    total = sources.source_bytes(sources.resolve_sources(data_cfg), data_cfg)
    if sources.is_pretokenized(data_cfg):
        tasks: Iterator[tuple[int, Any]] = _shard_chunks(
            read_token_files(data_cfg, tokenizer.vocab_size, tokenizer.eos_id, stats), dtype.itemsize, manifest)
        workers = 0  # nothing to encode: the ids are copied
    else:
        tasks = _shard_tasks(sources.read_pieces(data_cfg, stats, sources.BLOCK_BYTES), manifest)
        workers = _num_proc(data_cfg) if tokenizer.worker_spec() and (total is None or total > 4 * TASK_BYTES) else 0
    how = f"{workers} worker process{'es' if workers != 1 else ''}" if workers else "in-process"
    if manifest.shards:
        print(f"resuming {path}: {len(manifest.shards)} finished shard(s) kept", file=sys.stderr)
    progress = Progress(f"tokenizing data.sources ({how})", total, str(path))
    writer = _ShardWriter(manifest, dtype)
    with _encoder(tokenizer, dtype, workers) as encode:
        for shard, tokens in encode(tasks):
            writer.add(shard, tokens)
            progress.update(stats.done_bytes)
    writer.close()
    manifest.finish(num_shards=manifest.seen_shards, documents=stats.documents, skipped=dict(stats.skipped))
    num_tokens = sum(s["num_tokens"] for s in manifest.shards.values())
    progress.close(f"{stats.documents:,} documents, {num_tokens:,} tokens")
    for line in sources.skip_lines(stats.skipped):
        print(line, file=sys.stderr)


def _num_proc(data_cfg: DataConfig) -> int:
    """``data.num_proc``, default every core this process may run on."""
    return data_cfg.num_proc or len(os.sched_getaffinity(0))


def _shard_tasks(pieces: Iterable[sources.Piece], manifest: Manifest) -> Iterator[tuple[int, Any]]:
    """(shard, (texts, flags)) tasks of about `TASK_BYTES` of text, each shard about `SHARD_BYTES` of text, for the
    shards the manifest lacks; a piece's flags say whether it starts and ends its document
    (`encode_worker.START`, `END`). A pure function of the piece stream, so a resumed run cuts the same shards."""
    shard, shard_bytes, texts, flags, size = 0, 0, [], [], 0
    opened = False  # the current shard has a task
    starts = True  # the next piece starts a document
    for piece in pieces:
        texts.append(piece.text)
        flags.append(encode_worker.START * starts | encode_worker.END * piece.end)
        starts = piece.end
        size += len(piece.text)
        if size >= TASK_BYTES:
            if shard not in manifest.shards:
                yield shard, (texts, flags)
            shard_bytes, opened = shard_bytes + size, True
            texts, flags, size = [], [], 0
            if shard_bytes >= SHARD_BYTES:
                shard, shard_bytes, opened = shard + 1, 0, False
    if texts:
        if shard not in manifest.shards:
            yield shard, (texts, flags)
        opened = True
    manifest.seen_shards = shard + opened


def _shard_chunks(chunks: Iterable[np.ndarray], itemsize: int, manifest: Manifest) -> Iterator[tuple[int, Any]]:
    """(shard, ids) for token arrays: shards of about `SHARD_BYTES` of ids."""
    shard, shard_bytes = 0, 0
    for chunk in chunks:
        if shard not in manifest.shards:
            yield shard, chunk
        shard_bytes += len(chunk) * itemsize
        if shard_bytes >= SHARD_BYTES:
            shard, shard_bytes = shard + 1, 0
    manifest.seen_shards = shard + (shard_bytes > 0)


@contextlib.contextmanager
def _encoder(tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> Iterator[Any]:
    """A function from (tag, task) pairs to (tag, tokens) pairs, in order: in ``workers`` processes, or in-process
    when 0. A task is (texts, ends) to encode, or ids to pass on."""
    if not workers:
        def encode(tasks: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, np.ndarray]]:
            for tag, task in tasks:
                yield tag, task if isinstance(task, np.ndarray) else encode_pieces(
                    tokenizer.encode_batch, *task, tokenizer.eos_id, tokenizer.bos_prefix, dtype.str)

        yield encode
        return
    pool = _Workers(tokenizer, dtype, workers)
    try:
        yield pool.map
    finally:
        pool.close()


class _Workers:
    """``n`` `jaxtune.data.encode_worker` processes, fed round-robin with one task each in flight: task ``i`` goes
    to worker ``i % n``, so reading results in submission order keeps the source order, and a worker is never
    writing a result while we write it a task (no pipe deadlock)."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, n: int):
        kind, payload = tokenizer.worker_spec() or ("", "")
        # One thread each: the processes are the parallelism. Their own session: Ctrl-C reaches only us, and we
        # stop them (a worker also exits when our end of its stdin closes, even if we are killed with -9).
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
        self.dtype = dtype
        self.procs = [subprocess.Popen([sys.executable, "-P", encode_worker.__file__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env, start_new_session=True) for _ in range(n)]
        setup = json.dumps({"kind": kind, "payload": payload, "eos_id": tokenizer.eos_id,
                            "bos": list(tokenizer.bos_prefix), "dtype": dtype.str})
        for proc in self.procs:
            encode_worker.send(proc.stdin, setup.encode())

    def map(self, tasks: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, np.ndarray]]:
        in_flight: collections.deque[tuple[subprocess.Popen, int]] = collections.deque()
        for i, (tag, (texts, flags)) in enumerate(tasks):
            if len(in_flight) == len(self.procs):
                yield self._result(*in_flight.popleft())
            proc = self.procs[i % len(self.procs)]
            encode_worker.send(proc.stdin, encode_worker.pack(texts, flags))
            in_flight.append((proc, tag))
        while in_flight:
            yield self._result(*in_flight.popleft())

    def _result(self, proc: subprocess.Popen, tag: int) -> tuple[int, np.ndarray]:
        frame = encode_worker.receive(proc.stdout)
        if frame is None:
            raise RuntimeError(f"tokenizing worker {proc.pid} exited (code {proc.wait()}); its error is above")
        return tag, np.frombuffer(frame, dtype=self.dtype)

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.kill()
            proc.wait()
            proc.stdout.close()


def shard_name(index: int) -> str:
    return f"{index:05d}.bin"


class Manifest:
    """``manifest.json`` in the shard directory: the layout the shards were cut with, each finished shard's
    ``num_tokens``, ``bytes`` and ``sha256``, and once every shard is written, ``complete`` (the shard count,
    documents and skips). Loading keeps only the shards whose file matches its record; the rest are redone."""

    def __init__(self, directory: Path, layout: dict, shards: dict[int, dict], complete: dict | None):
        self.directory, self.layout, self.shards, self.complete = directory, layout, shards, complete
        self.seen_shards = 0

    @classmethod
    def load(cls, directory: Path, layout: dict) -> Manifest:
        file = directory / "manifest.json"
        try:
            saved = json.loads(file.read_text()) if file.is_file() else {}
        except (OSError, ValueError):
            print(f"{file}: unreadable; tokenizing from the start", file=sys.stderr)
            saved = {}
        if saved.get("layout") != layout:  # none yet, or cut another way: what is there cannot be reused
            saved = {}
        shards, complete = {}, saved.get("complete")
        for name, record in saved.get("shards", {}).items():
            shard = directory / shard_name(int(name))
            if _matches(shard, record):
                shards[int(name)] = record
            else:
                print(f"{shard}: does not match its size or checksum in {file}; redoing it", file=sys.stderr)
                shard.unlink(missing_ok=True)
                complete = None
        for stray in directory.glob("*.bin"):  # written but never recorded (killed between rename and manifest)
            if int(stray.stem) not in shards:
                stray.unlink()
        return cls(directory, layout, shards, complete)

    def add(self, index: int, record: dict) -> None:
        self.shards[index] = record
        self._save()

    def finish(self, **complete: Any) -> None:
        self.complete = complete
        self._save()

    def _save(self) -> None:
        write_text_atomically(self.directory / "manifest.json", json.dumps(
            {"layout": self.layout, "shards": {str(k): v for k, v in sorted(self.shards.items())},
             "complete": self.complete}, indent=1) + "\n")


def _matches(shard: Path, record: dict) -> bool:
    if not shard.is_file() or shard.stat().st_size != record.get("bytes"):
        return False
    h = hashlib.sha256()
    with shard.open("rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest() == record.get("sha256")


class _ShardWriter:
    """Appends each shard's tokens to a temp file; a shard is renamed into place and recorded in the manifest when
    the next one starts (or at ``close``), so a killed run leaves only whole, recorded shards (and a temp file)."""

    def __init__(self, manifest: Manifest, dtype: np.dtype):
        self.manifest, self.dtype = manifest, dtype
        self.index: int | None = None
        self.file: Any = None

    def add(self, index: int, tokens: np.ndarray) -> None:
        if index != self.index:
            self.close()
            self.index, self.hash, self.count = index, hashlib.sha256(), 0
            self.target = self.manifest.directory / shard_name(index)
            self.tmp = self.target.with_name(f"{self.target.name}.tmp-{os.getpid()}")
            self.file = self.tmp.open("wb")
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.count += len(tokens)

    def close(self) -> None:
        if self.file is None:
            return
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        os.replace(self.tmp, self.target)
        assert self.index is not None
        self.manifest.add(self.index, {"num_tokens": self.count, "bytes": self.count * self.dtype.itemsize,
                                       "sha256": self.hash.hexdigest()})
