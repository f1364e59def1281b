"""Tokenizing in worker processes: the pieces of text one task holds → their ids, each document followed by eos
(and preceded by the tokenizer's BOS, for a checkpoint tokenizer that adds one: Llama 3, Gemma).

`jaxtune.data.tokens` starts ``data.num_proc`` of these as ``python -P encode_worker.py`` (a fresh interpreter
that imports numpy and the tokenizer library only: no jax, no jaxtune, so each starts in a fraction of a second and
holds tens of MB) and talks to each over its stdin/stdout. Every message is a frame: an 8-byte little-endian length,
then that many bytes. The first frame is the setup (JSON: the tokenizer, the eos and bos ids, the dtype); then each task
frame (`pack`) is answered by one frame of token bytes, in order. A worker exits at the end of its stdin, so it
never outlives its parent (even one killed with -9).

The same `encode_pieces` runs in the parent when it tokenizes in-process, so the tokens do not depend on where they
were made.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

Encode = Callable[[list[str]], list[list[int]]]
_LENGTH = struct.Struct("<Q")
# A piece's flags: it starts its document (the BOS goes before it), it ends its document (the eos goes after it).
START, END = 2, 1


def hf_ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """A ``tokenizers.Tokenizer``'s ids of ``texts``, no special tokens added (``encode_batch_fast`` skips the
    character offsets, which we never use)."""
    return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def make_encoder(kind: str, payload: str) -> Encode:
    """The encoder a `jaxtune.data.tokenizer.Tokenizer.worker_spec` names: ``hf`` (a tokenizer.json string, with
    special-token text encoded as text) or ``tiktoken`` (an encoding name). One thread: the processes are the
    parallelism."""
    if kind == "hf":
        import tokenizers

        tok = tokenizers.Tokenizer.from_str(payload)
        tok.encode_special_tokens = True
        return lambda texts: hf_ids(tok, texts)
    if kind == "tiktoken":
        import tiktoken

        enc = tiktoken.get_encoding(payload)
        return lambda texts: enc.encode_ordinary_batch(texts, num_threads=1)
    raise ValueError(f"unknown tokenizer kind {kind!r}")


def encode_pieces(encode: Encode, texts: list[str], flags: list[int], eos_id: int, bos: list[int] | tuple[int, ...],
                  dtype: str) -> np.ndarray:
    """(tokens,) ``dtype``: the ids of every piece in order, ``bos`` before each piece that starts its document
    (`START`) and ``eos_id`` after each piece that ends it (`END`)."""
    flat: list[int] = []
    for ids, flag in zip(encode(texts), flags, strict=True):
        if flag & START:
            flat += bos
        flat += ids
        if flag & END:
            flat.append(eos_id)
    return np.array(flat, dtype=dtype)


def pack(texts: list[str], flags: list[int]) -> bytes:
    """A task frame: the piece count, each piece's UTF-8 length, each piece's flags (one byte), the texts."""
    data = [t.encode("utf-8") for t in texts]
    lengths = np.array([len(d) for d in data], dtype="<i8")
    return struct.pack("<Q", len(data)) + lengths.tobytes() + np.array(flags, dtype="u1").tobytes() + b"".join(data)


def unpack(frame: bytes) -> tuple[list[str], list[int]]:
    (n,) = struct.unpack_from("<Q", frame)
    lengths = np.frombuffer(frame, dtype="<i8", count=n, offset=8)
    flags = np.frombuffer(frame, dtype="u1", count=n, offset=8 + 8 * n).tolist()
    pos = 8 + 9 * n
    texts = []
    for size in lengths.tolist():
        texts.append(frame[pos : pos + size].decode("utf-8"))
        pos += size
    return texts, flags


def send(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def receive(stream: BinaryIO) -> bytes | None:
    """The next frame, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return data


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = receive(stdin)
    if setup is None:
        return
    spec = json.loads(setup)
    encode = make_encoder(spec["kind"], spec["payload"])
    while (frame := receive(stdin)) is not None:
        texts, flags = unpack(frame)
        send(stdout, encode_pieces(encode, texts, flags, spec["eos_id"], spec["bos"], spec["dtype"]).tobytes())


if __name__ == "__main__":
    main()
