"""Pretraining data at scale: sources read in blocks, long documents cut, tokenizing in worker processes into a
resumable sharded cache, pre-tokenized files, bad bytes. Tiny block, task and shard sizes force every path."""

import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtune.config import DataConfig, TokenizerConfig
from jaxtune.data import DataError, load_hf_tokenizer, load_tokenizer, prepare_tokens, sources
from jaxtune.data import shards as shards_module
from jaxtune.data.sources import Piece, ReadStats, read_pieces

SEP = "<|endoftext|>"


def story(i: int) -> str:
    return f"Story {i}: Tom saw {i % 7} red birds.\nLily laughed, and the dog ran {i * 3} times around the tree."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "train.txt").write_text(f"\n{SEP}\n".join(story(i) for i in range(300)) + " naïve café 🙂")
    return load_tokenizer(TokenizerConfig(vocab_size=300, train_bytes=50_000),
                          DataConfig(sources=[str(root / "train.txt")], cache_dir=str(root / "cache")))


@pytest.fixture
def tiny(monkeypatch):
    """Blocks of 256 bytes, tasks of 1 kB, shards of 4 kB: a 40 kB corpus is ~10 shards of ~4 tasks."""
    monkeypatch.setattr(sources, "BLOCK_BYTES", 256)
    monkeypatch.setattr(shards_module, "TASK_BYTES", 1024)
    monkeypatch.setattr(shards_module, "SHARD_BYTES", 4096)


def corpus(path, n=400):
    path.write_text(f"\n{SEP}\n".join(story(i) for i in range(n)) + f"\n{SEP}\n")
    return path


def cfg(tmp_path, src, cache="cache", **kw):
    return DataConfig(**{"sources": [str(src)], "seq_len": 16, "val_fraction": 0.1, "cache_dir": str(tmp_path / cache)}
                      | kw)


def expected_tokens(tok, docs):
    return np.array([t for d in docs for t in (*tok.encode(d), tok.eos_id)], dtype=np.uint16)


# --- blocks and cuts --------------------------------------------------------------------------------------------------


def test_chunked_equals_whole_file_tokens_for_short_documents(tmp_path, tok, tiny):
    src = corpus(tmp_path / "stories.txt")
    data = prepare_tokens(cfg(tmp_path, src, num_proc=2), tok)
    docs = [d.strip() for d in src.read_text().split(SEP) if d.strip()]
    assert all(len(d.encode()) <= 256 for d in docs)  # every document fits a block: read in 256-byte blocks
    np.testing.assert_array_equal(data.tokens, expected_tokens(tok, docs))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([data.path.name,
                                                                            data.path.with_suffix(".json").name])


@pytest.mark.parametrize("kind", ["lines", "spaces", "characters"])
def test_long_documents_are_cut_into_block_pieces_tokenized_apart(tmp_path, tok, kind, monkeypatch):
    doc = {"lines": "\n".join(story(i) for i in range(40)),
           "spaces": " ".join(f"word{i}" for i in range(2000)),
           "characters": "é" * 3000 + "x" * 7}[kind]
    (tmp_path / "long.txt").write_text(doc)
    pieces = list(read_pieces(cfg(tmp_path, tmp_path / "long.txt"), block_bytes=256))
    assert "".join(p.text for p in pieces) == doc and [p.end for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert len(pieces) > 10 and all(len(p.text.encode()) <= 256 for p in pieces)
    if kind == "lines":  # cut after a newline: no line is split
        assert all(p.text.endswith("\n") for p in pieces[:-1])
    if kind == "spaces":  # cut before a space: the space stays with the word it precedes, every word is whole
        assert all(p.text.startswith(" ") for p in pieces[1:]) and all(not p.text.endswith(" ") for p in pieces)
    # What the cache holds: each piece tokenized on its own, one eos after the last.
    monkeypatch.setattr(sources, "BLOCK_BYTES", 256)
    data = prepare_tokens(cfg(tmp_path, tmp_path / "long.txt", num_proc=1), tok)
    expected = [t for p in pieces for t in tok.encode(p.text)] + [tok.eos_id]
    np.testing.assert_array_equal(data.tokens, expected)
    if kind == "lines":  # at a newline followed by text, the cut changes no token at all
        np.testing.assert_array_equal(data.tokens[:-1], tok.encode(doc))


def test_identical_token_file_for_any_number_of_workers(tmp_path, tok, tiny):
    src = corpus(tmp_path / "stories.txt")
    files = []
    for n in (1, 2, 3):
        data = prepare_tokens(cfg(tmp_path, src, cache=f"cache{n}", num_proc=n), tok)
        files.append(data.path.read_bytes())
    in_process = prepare_tokens(cfg(tmp_path, src, cache="inproc"), _InProcess(tok)).path.read_bytes()
    assert files[0] == files[1] == files[2] == in_process and len(files[0]) > 4 * 4096 // 4


class _InProcess:
    """The tokenizer without a worker spec: tokenized in the calling process."""

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size, self.eos_id, self.fingerprint = tok.vocab_size, tok.eos_id, tok.fingerprint
        self.bos_prefix = tok.bos_prefix

    def worker_spec(self):
        return None

    def encode_batch(self, texts):
        return self._tok.encode_batch(texts)


def test_checkpoint_tokenizer_bos_starts_every_document(tmp_path, tok, tiny):
    """A checkpoint tokenizer that puts BOS before a text (Llama 3, Gemma: its post-processor) gets it before every
    document in the token file, as the model was pretrained, once per document however many pieces the document is
    cut into, and the same file in-process and in worker processes; a tokenizer without one is unchanged."""
    from tokenizers import Tokenizer, processors

    spec = Tokenizer.from_str(tok._tok.to_str())
    spec.add_special_tokens(["<bos>"])
    bos = spec.token_to_id("<bos>")
    spec.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    (tmp_path / "tok").mkdir()
    spec.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": SEP}))
    with_bos = load_hf_tokenizer(str(tmp_path / "tok"))
    assert with_bos.bos_prefix == (bos,)
    docs = [story(i) if i % 2 else "\n".join(story(j) for j in range(i, i + 12)) for i in range(10)]  # long: 1.1 kB
    (tmp_path / "mixed.txt").write_text(f"\n{SEP}\n".join(docs))  # 6 kB: worker processes take > 4 kB
    pieces = list(read_pieces(cfg(tmp_path, tmp_path / "mixed.txt"), block_bytes=256))
    assert len(pieces) > 20 and sum(p.end for p in pieces) == 10
    files = []
    for n, tokenizer in [(2, with_bos), (None, _InProcess(with_bos))]:
        data = prepare_tokens(cfg(tmp_path, tmp_path / "mixed.txt", cache=f"bos{n}", num_proc=n), tokenizer)
        files.append(data.path.read_bytes())
    expected, start = [], True
    for piece in pieces:
        expected += [bos] * start + with_bos.encode(piece.text) + [with_bos.eos_id] * piece.end
        start = piece.end
    np.testing.assert_array_equal(data.tokens, expected)
    assert files[0] == files[1] and list(data.tokens).count(bos) == 10
    plain = prepare_tokens(cfg(tmp_path, tmp_path / "mixed.txt", cache="plain", num_proc=2), tok)
    assert tok.bos_prefix == () and plain.tokens[0] != bos and list(plain.tokens).count(tok.eos_id) == 10
    np.testing.assert_array_equal(plain.tokens, [t for t in expected if t != bos])


# --- resuming ---------------------------------------------------------------------------------------------------------


class Killed(Exception):
    pass


def interrupted(tmp_path, tok, monkeypatch, shards: int, num_proc: int):
    """(the corpus, its uninterrupted token file): a second run into ``tmp_path/cache`` died (like Ctrl-C) once
    ``shards`` shards were recorded; the writer works again afterwards."""
    src = corpus(tmp_path / "stories.txt")
    whole = prepare_tokens(cfg(tmp_path, src, cache="whole", num_proc=num_proc), tok).path.read_bytes()
    real = shards_module.Manifest.add

    def add(self, index, record):
        if len(self.shards) >= shards:
            raise Killed
        real(self, index, record)

    with monkeypatch.context() as patch:
        patch.setattr(shards_module.Manifest, "add", add)
        with pytest.raises(Killed):
            prepare_tokens(cfg(tmp_path, src, num_proc=num_proc), tok)
    return src, whole


def test_interrupted_tokenizing_resumes_with_identical_tokens(tmp_path, tok, tiny, monkeypatch, capsys):
    src, whole = interrupted(tmp_path, tok, monkeypatch, shards=3, num_proc=2)
    shard_dir = next((tmp_path / "cache").glob("*.shards"))
    assert sorted(json.loads((shard_dir / "manifest.json").read_text())["shards"]) == ["0", "1", "2"]
    (shard_dir / "00007.bin.tmp-999").write_bytes(b"xx")  # a killed writer's temp file
    encoded = []
    real_encode = shards_module.encode_pieces
    monkeypatch.setattr(shards_module, "encode_pieces", lambda *a: encoded.append(1) or real_encode(*a))
    capsys.readouterr()
    resumed = prepare_tokens(cfg(tmp_path, src, num_proc=1), _InProcess(tok))  # in-process: its tasks counted
    assert "3 finished shard(s) kept" in capsys.readouterr().err
    assert resumed.path.read_bytes() == whole
    assert 0 < len(encoded) < -(-len(src.read_bytes()) // 1024) - 3 * 4  # the first 3 shards were not redone
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([resumed.path.name,
                                                                            resumed.path.with_suffix(".json").name])


KILL_AFTER_SHARDS = """
import os, signal, sys
from jaxtune.config import DataConfig
from jaxtune.data import load_tokenizer_dir, prepare_tokens, sources
from jaxtune.data import shards as shards_module
sources.BLOCK_BYTES, shards_module.TASK_BYTES, shards_module.SHARD_BYTES = 256, 1024, 4096  # the `tiny` sizes
real = shards_module.Manifest.add
def add(self, index, record):
    real(self, index, record)
    if len(self.shards) == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally: workers and temp files left as they are
shards_module.Manifest.add = add
src, cache, tok = sys.argv[1:]
prepare_tokens(DataConfig(sources=[src], seq_len=16, val_fraction=0.1, cache_dir=cache, num_proc=2),
               load_tokenizer_dir(tok))
"""


def test_tokenizing_killed_with_sigkill_resumes_with_identical_tokens(tmp_path, tok, tiny, capsys):
    import signal
    import subprocess
    import sys

    src = corpus(tmp_path / "stories.txt")
    whole = prepare_tokens(cfg(tmp_path, src, cache="whole", num_proc=2), tok).path.read_bytes()
    tok.save(tmp_path / "tok")
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_SHARDS, str(src), str(tmp_path / "cache"),
                             str(tmp_path / "tok")], check=False, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not list((tmp_path / "cache").glob("tokens-*.bin"))  # killed before the token file was joined
    capsys.readouterr()
    resumed = prepare_tokens(cfg(tmp_path, src, num_proc=2), tok)
    assert "3 finished shard(s) kept" in capsys.readouterr().err  # resumed, not started over
    assert resumed.path.read_bytes() == whole


def test_a_corrupted_shard_is_redone_never_read(tmp_path, tok, tiny, monkeypatch, capsys):
    src, whole = interrupted(tmp_path, tok, monkeypatch, shards=4, num_proc=1)
    shard = next((tmp_path / "cache").glob("*.shards")) / "00001.bin"
    damaged = bytearray(shard.read_bytes())
    damaged[10] ^= 0xFF  # same size, wrong checksum
    shard.write_bytes(bytes(damaged))
    assert prepare_tokens(cfg(tmp_path, src, num_proc=1), tok).path.read_bytes() == whole
    assert f"{shard}: does not match its size or checksum" in capsys.readouterr().err


# --- pre-tokenized sources --------------------------------------------------------------------------------------------


def test_pretokenized_files(tmp_path, tok):
    ids = np.arange(1000, dtype=np.uint16) % tok.vocab_size
    (tmp_path / "train.bin").write_bytes(ids.tobytes())  # nanoGPT: raw uint16
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, 1, len(ids)]
    (tmp_path / "llmc.bin").write_bytes(header.tobytes() + ids.tobytes())  # llm.c: header, then uint16
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    for name in ("train.bin", "llmc.bin", "ids.npy"):
        data = prepare_tokens(cfg(tmp_path, tmp_path / name, cache=f"cache-{name}"), tok)
        np.testing.assert_array_equal(data.tokens, ids)
    # parquet (data.format: tokens): one document per row, eos appended.
    rows = [[1, 2, 3], [4, 5], [6, tok.eos_id]]
    pq.write_table(pa.table({"input_ids": rows}), tmp_path / "ids.parquet")
    data = prepare_tokens(cfg(tmp_path, tmp_path / "ids.parquet", cache="pq", format="tokens", seq_len=2), tok)
    np.testing.assert_array_equal(data.tokens, [1, 2, 3, tok.eos_id, 4, 5, tok.eos_id, 6, tok.eos_id])


def test_token_ids_beyond_the_vocabulary_name_file_and_position(tmp_path, tok):
    ids = np.zeros(500, dtype=np.uint16)
    ids[321] = tok.vocab_size
    (tmp_path / "train.bin").write_bytes(ids.tobytes())
    with pytest.raises(DataError, match=rf"train.bin: token 321 is id {tok.vocab_size}, not below .* tokenizer.kind"):
        prepare_tokens(cfg(tmp_path, tmp_path / "train.bin"), tok)
    with pytest.raises(DataError, match="data.token_eos_id=7 is not the tokenizer's eos id"):
        prepare_tokens(cfg(tmp_path, tmp_path / "train.bin", token_eos_id=7), tok)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="odd.bin: 3 bytes is not a whole number of uint16 ids"):
        prepare_tokens(cfg(tmp_path, tmp_path / "odd.bin"), tok)


# --- bad bytes --------------------------------------------------------------------------------------------------------


def bad_corpus(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(f"good one\n{SEP}\n".encode() + b"caf\xe9 latin-1\n" + f"{SEP}\nbin".encode() + b"\x00\x01ary"
                     + f"{SEP}\ngood two".encode())
    return path


def test_bad_bytes_are_an_error_naming_file_and_offset(tmp_path, tok):
    path = bad_corpus(tmp_path)
    with pytest.raises(DataError, match=rf"{path}: byte 26: not valid UTF-8 .*data.bad_rows=drop"):
        prepare_tokens(cfg(tmp_path, path), tok)
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)  # /bin/ls as a .txt
    with pytest.raises(DataError, match=rf"{path}: byte 7: a NUL byte \(binary data, not text\)"):
        prepare_tokens(cfg(tmp_path, path), tok)


def test_bad_bytes_under_drop_skip_the_document_counted_and_printed(tmp_path, tok, capsys):
    path = bad_corpus(tmp_path)
    data = prepare_tokens(cfg(tmp_path, path, bad_rows="drop", seq_len=2), tok)
    np.testing.assert_array_equal(data.tokens, expected_tokens(tok, ["good one", "good two"]))
    err = capsys.readouterr().err
    assert f"skipped {path}: byte 26: not valid UTF-8" in err and f"skipped {path}: byte 53: a NUL byte" in err
    assert data.skipped == {"non_utf8": 1, "nul_bytes": 1}
    assert data.report() == [("data.sources: skipped 2 document(s) with bad bytes (1 non_utf8, 1 nul_bytes); "
                              "data.bad_rows=drop")]
    meta = json.loads(data.path.with_suffix(".json").read_text())
    assert meta["skipped"] == data.skipped and meta["num_documents"] == 2


# --- memory -----------------------------------------------------------------------------------------------------------


def test_one_huge_document_streams_in_bounded_memory(tmp_path):
    block = 64 << 10
    line = "the quick brown fox jumps over the lazy dog " * 20 + "\n"
    path = tmp_path / "huge.txt"
    with path.open("w") as f:
        while f.tell() < 50 * block:
            f.write(line)
    stats = ReadStats()
    tracemalloc.start()
    try:
        count = size = 0
        for piece in read_pieces(cfg(tmp_path, path), stats, block_bytes=block):
            count, size = count + 1, size + len(piece.text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == path.stat().st_size and count >= 50 and stats.documents == 1
    assert peak < 8 * block, f"peak {peak} bytes reading a {50 * block}-byte document in {block}-byte blocks"


def test_json_array_is_parsed_one_element_at_a_time(tmp_path):
    path = tmp_path / "docs.json"
    path.write_text("[\n" + ",\n".join(json.dumps({"text": story(i)}) for i in range(200)) + "\n]")
    docs = list(read_pieces(cfg(tmp_path, path), block_bytes=256))
    assert docs == [Piece(story(i), end=True) for i in range(200)]
    path.write_text('[{"text": "a"},\n{"text": "b"}\n{"text": "c"}]')
    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON \(expected ',' or '\]'"):
        list(read_pieces(cfg(tmp_path, path), block_bytes=256))
