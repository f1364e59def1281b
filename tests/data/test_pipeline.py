import json
import math
import multiprocessing
import pickle
from pathlib import Path

import numpy as np
import pytest

from jaxtune.config import DataConfig, TokenizerConfig
from jaxtune.data import (
    DataError,
    TokenData,
    iter_documents,
    load_tokenizer,
    make_eval_batches,
    make_train_iterator,
    prepare_tokens,
    test_sequences,
)
from jaxtune.data import tokens as tokens_module

SEQ = 4  # window length of the synthetic streams below


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(data_cfg, tokenizer, TokenData) for 100 kB of stdlib, small vocab, seq_len 32."""
    cfg = DataConfig(max_bytes=100_000, seq_len=32, val_fraction=0.1, cache_dir=str(tmp_path_factory.mktemp("cache")))
    tok = load_tokenizer(TokenizerConfig(vocab_size=512, train_bytes=100_000), cfg)
    return cfg, tok, prepare_tokens(cfg, tok)


def arange_data(tmp_path, num_tokens, val_fraction=0.0):
    """A memmapped TokenData whose token k is k, so a window's first token is its offset in the stream."""
    path = tmp_path / "arange.bin"
    np.arange(num_tokens, dtype=np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", shape=(num_tokens,))
    return TokenData(tokens=tokens, seq_len=SEQ, val_fraction=val_fraction, path=path)


def positions(num_tokens, seq_len, val_fraction):
    """The layout of any stream of ``num_tokens``: a TokenData over 0..n-1, whose windows are their offsets."""
    return TokenData(np.arange(num_tokens), seq_len, val_fraction, Path("positions-only"))


def starts(data, split):
    return np.array([data.window(i, split)[0] for i in range(data.windows(split))], dtype=np.int64)


def take(it, n):
    return [next(it) for _ in range(n)]


def window_ids(batches):
    return [int(x) // SEQ for b in batches for x in b["inputs"][:, 0]]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])


# --- token cache -------------------------------------------------------------------------------------------


def test_token_stream_is_documents_each_followed_by_eos(corpus):
    cfg, tok, data = corpus
    expected = [t for doc in iter_documents(cfg) for t in (*tok.encode(doc), tok.eos_id)]
    assert data.tokens.dtype == np.uint16 and isinstance(data.tokens, np.memmap)
    np.testing.assert_array_equal(data.tokens, expected)


def test_token_cache_is_reused(corpus, monkeypatch):
    cfg, tok, data = corpus

    def no_tokenizing(*args):
        raise AssertionError("re-tokenized although the cache is complete")

    monkeypatch.setattr(tokens_module, "_write_tokens", no_tokenizing)
    again = prepare_tokens(cfg, tok)
    assert again.path == data.path
    np.testing.assert_array_equal(again.tokens, data.tokens)
    assert sorted(p.suffix for p in data.path.parent.glob("tokens-*")) == [".bin", ".json"]  # no temp leftovers


def test_half_written_files_are_ignored(corpus, tmp_path):
    cfg, tok, data = corpus
    cfg = cfg.model_copy(update={"cache_dir": str(tmp_path)})
    name = data.path.name  # same sources and tokenizer: same key in any cache directory
    (tmp_path / f"{name}.tmp-123-abcdef01").write_bytes(b"\x01\x02" * 7)  # a killed writer's temp file
    (tmp_path / name).write_bytes(data.tokens[:100].tobytes())  # a .bin without its sidecar
    fresh = prepare_tokens(cfg, tok)
    np.testing.assert_array_equal(fresh.tokens, data.tokens)

    # A sidecar that does not match the .bin's size (e.g. a truncated copy) also means: re-tokenize.
    (tmp_path / name).write_bytes(data.tokens[:100].tobytes())
    np.testing.assert_array_equal(prepare_tokens(cfg, tok).tokens, data.tokens)


def test_windows_are_shifted_slices_and_splits_disjoint(corpus):
    _, _, data = corpus
    T, n = data.seq_len, len(data.tokens)
    layout = positions(n, T, 0.1)
    train_starts, val_starts = starts(layout, "train"), starts(layout, "val")
    used = data.train_windows + data.val_windows
    assert data.val_windows == math.ceil(used / 10) and used >= (n - 1) // T - 2  # P = round(1 / 0.1) = 10
    # Spread over the stream: a validation run within every period of at most 10 blocks of 8 windows.
    assert val_starts[0] < 10 * 8 * T and val_starts[-1] + T + 1 > n - 10 * 8 * T - 2
    assert np.diff(val_starts).max() <= 10 * 8 * T + 2
    it = make_train_iterator(data, global_batch=8, seed=0)
    for batch in take(it, 3):
        assert batch["inputs"].shape == batch["targets"].shape == (8, T) and batch["inputs"].dtype == np.int32
        for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
            found = [o for o in train_starts if np.array_equal(data.tokens[o : o + T], inputs)]
            assert found, "a training row is not a training window of the token stream"
            np.testing.assert_array_equal(targets, data.tokens[found[0] + 1 : found[0] + T + 1])
    it.close()
    (val,) = make_eval_batches(data, batch_size=4, num_batches=1)
    o = val_starts[3 * data.val_windows // 8]  # row g of n rows: validation window (2g + 1) * val_windows // 2n
    np.testing.assert_array_equal(val["inputs"][1], data.tokens[o : o + T])
    np.testing.assert_array_equal(val["targets"][1], data.tokens[o + 1 : o + T + 1])
    # Workers get the TokenData pickled as its path; the copy cuts the same windows.
    again = pickle.loads(pickle.dumps(data))
    assert (again.train_windows, again.val_windows) == (data.train_windows, data.val_windows)
    np.testing.assert_array_equal(again.window(data.val_windows - 1, "val"), data.window(data.val_windows - 1, "val"))


@pytest.mark.parametrize("seq_len", [2, 5])
@pytest.mark.parametrize("val_fraction", [0.0, 0.02, 0.1, 0.3, 0.5])
def test_split_keeps_every_window_inside_the_stream_and_apart(seq_len, val_fraction):
    T = seq_len
    period = round(1 / val_fraction) if val_fraction else None
    for n in [*range(1, 70), 1000, 6001, 12345]:  # blocks of 1 window up to 8 (n=12345, val_fraction ≥ 0.1)
        data = positions(n, T, val_fraction)
        covered = {}
        for split in ("train", "val"):
            used = set()
            for i in range(data.windows(split)):
                window = data.window(i, split)
                # A whole window of the stream: seq_len + 1 consecutive tokens, inside it.
                np.testing.assert_array_equal(window, np.arange(window[0], window[0] + T + 1))
                assert window[-1] < n
                used.update(window.tolist())
            covered[split] = used
            with pytest.raises(IndexError):
                data.window(data.windows(split), split)
        assert not covered["train"] & covered["val"], f"n={n}: a token is in both splits"
        total, train, val = (n - 1) // T, data.train_windows, data.val_windows
        if period is None:
            assert (train, val) == (total, 0)
            continue
        assert val == math.ceil((train + val) / period)  # the share 1 / period, to within one window
        # Only two tokens a period and less than a window at the end go unused.
        assert n - len(covered["train"] | covered["val"]) < T + 2 * (n // (period * T) + 1)
        if n >= 2 * T + 2:
            assert train >= 1 and val >= 1, f"n={n}: a small corpus lost a split"


def test_validation_comes_from_every_part_of_the_corpus(corpus, tmp_path):
    # Sources are read in path order; a tail split would make "b_tables.txt", the last tenth, all of validation.
    _, tok, _ = corpus
    prose = " ".join(f"the fox walked past the old mill and counted {i} sheep." for i in range(600))
    tables = "".join(f"0x{i:04x}: 0x{(i * 7919) % 65536:04x},\n" for i in range(150))
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a_prose.txt").write_text(prose)
    (src / "b_tables.txt").write_text(tables)
    cfg = DataConfig(sources=[str(src)], seq_len=32, val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    data = prepare_tokens(cfg, tok)
    n, boundary = len(data.tokens), len(tok.encode(prose)) + 1  # the tables start after prose + eos
    tables_share = (n - boundary) / n
    assert 0.08 < tables_share < 0.12, tables_share
    layout = positions(n, data.seq_len, data.val_fraction)
    for split in ("train", "val"):
        in_tables = int((starts(layout, split) >= boundary).sum())
        assert 0 < in_tables < data.windows(split)  # both parts, in both splits
        assert abs(in_tables - tables_share * data.windows(split)) <= 2, (split, in_tables, data.windows(split))
    # The evaluation batches sample the tables too: 8 rows, the middle windows of the split's eighths.
    rows = [r for b in make_eval_batches(data, batch_size=4, num_batches=2) for r in b["inputs"]]
    assert any("0x" in tok.decode([int(t) for t in r]) for r in rows)


def test_val_fraction_above_half_is_an_error():
    # Validation is one block in every round(1 / val_fraction) ≥ 2: a larger share cannot be honoured.
    assert positions(100, SEQ, 0.5).val_windows == 10
    with pytest.raises(DataError, match=r"data.val_fraction=0.7 is above 0.5: .* lower data.val_fraction"):
        positions(100, SEQ, 0.7)


def test_too_few_tokens_for_seq_len(corpus):
    cfg, tok, data = corpus
    with pytest.raises(
        DataError, match=rf"data.seq_len=100000 leaves no training window: .* {len(data.tokens)} tokens"
    ):
        prepare_tokens(cfg.model_copy(update={"seq_len": 100_000}), tok)


# --- training iterator -------------------------------------------------------------------------------------


def test_order_is_a_function_of_seed_and_covers_each_epoch(tmp_path):
    data = arange_data(tmp_path, 40 * SEQ + 1)
    it = make_train_iterator(data, global_batch=4, seed=0)
    batches = take(it, 30)  # 3 epochs of 10 batches
    for b in batches:
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
        np.testing.assert_array_equal(b["inputs"] % SEQ, np.broadcast_to(np.arange(SEQ), (4, SEQ)))
    ids = window_ids(batches)
    epochs = [ids[0:40], ids[40:80], ids[80:120]]
    assert all(sorted(e) == list(range(40)) for e in epochs)  # every window exactly once per epoch
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # a new permutation each epoch
    assert epochs[0] != list(range(40))  # actually shuffled
    assert_same(batches, take(make_train_iterator(data, global_batch=4, seed=0), 30))
    assert window_ids(take(make_train_iterator(data, global_batch=4, seed=1), 10)) != epochs[0]
    # Grain reseeds epoch e with seed + e; hashing our seed first keeps seed 1 from replaying seed 0's epoch 1.
    assert window_ids(take(make_train_iterator(data, global_batch=4, seed=1), 10)) != epochs[1]


def test_state_resumes_exactly(tmp_path):
    data = arange_data(tmp_path, 10 * SEQ + 1)  # 7 + 5 batches of 3 cross epoch boundaries
    it = make_train_iterator(data, global_batch=3, seed=5)
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 5)
    fresh = make_train_iterator(data, global_batch=3, seed=5)
    fresh.set_state(state)
    assert_same(take(fresh, 5), expected)


def test_processes_take_contiguous_blocks_of_the_global_batch(tmp_path):
    """Process p of P holds the p-th block of every global batch, so the global array (process 0's rows, then
    process 1's) is the one-process batch row for row, and a state saved in P processes resumes in one."""
    data = arange_data(tmp_path, 13 * SEQ + 1)
    whole = take(make_train_iterator(data, global_batch=4, seed=3), 8)
    p0 = take(make_train_iterator(data, global_batch=4, seed=3, process_index=0, process_count=2), 8)
    p1 = take(make_train_iterator(data, global_batch=4, seed=3, process_index=1, process_count=2), 8)
    for g, a, b in zip(whole, p0, p1, strict=True):
        assert a["inputs"].shape == (2, SEQ)
        np.testing.assert_array_equal(np.concatenate([a["inputs"], b["inputs"]]), g["inputs"])
    it = make_train_iterator(data, global_batch=4, seed=3, process_index=1, process_count=2)
    take(it, 5)
    one = make_train_iterator(data, global_batch=4, seed=3)
    one.set_state(json.loads(json.dumps(it.get_state())))
    assert_same(take(one, 3), whole[5:8])
    with pytest.raises(DataError, match="train.batch_size=5 does not split over 2 processes"):
        make_train_iterator(data, global_batch=5, seed=0, process_count=2)


def test_worker_processes_give_the_same_batches(tmp_path):
    if "spawn" not in multiprocessing.get_all_start_methods():
        pytest.skip("grain workers need the spawn start method")
    data = arange_data(tmp_path, 20 * SEQ + 1)
    expected = take(make_train_iterator(data, global_batch=4, seed=2), 9)
    it = make_train_iterator(data, global_batch=4, seed=2, num_workers=1)
    try:
        assert_same(take(it, 6), expected[:6])
        state = json.loads(json.dumps(it.get_state()))
    finally:
        it.close()
    fresh = make_train_iterator(data, global_batch=4, seed=2, num_workers=1)
    try:
        fresh.set_state(state)
        assert_same(take(fresh, 3), expected[6:])
    finally:
        fresh.close()


# --- evaluation batches ------------------------------------------------------------------------------------


def test_eval_batches_spread_over_the_validation_windows(tmp_path):
    data = arange_data(tmp_path, 100, val_fraction=0.5)  # periods of 1 train + 1 val window (+2 tokens): 10 each
    assert (data.train_windows, data.val_windows) == (10, 10)
    val_starts = starts(data, "val")
    batches = make_eval_batches(data, batch_size=4, num_batches=8)
    assert len(batches) == 2  # only two full batches fit in 10 windows
    first_inputs = [int(x) for b in batches for x in b["inputs"][:, 0]]
    assert first_inputs == [val_starts[k] for k in (0, 1, 3, 4, 5, 6, 8, 9)]  # (2g + 1) * 10 // 16: both ends
    for b in batches:
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    (one,) = make_eval_batches(data, batch_size=4, num_batches=1)
    assert [int(x) for x in one["inputs"][:, 0]] == [val_starts[k] for k in (1, 3, 6, 8)]
    p1 = make_eval_batches(data, batch_size=4, num_batches=8, process_index=1, process_count=2)
    np.testing.assert_array_equal(p1[1]["inputs"], batches[1]["inputs"][2:])
    # A split smaller than one batch still gives one full batch, every window in it, in order.
    (small,) = make_eval_batches(data, batch_size=16, num_batches=2)
    small_inputs = [int(x) for x in small["inputs"][:, 0]]
    assert small_inputs == sorted(small_inputs) and set(small_inputs) == set(val_starts.tolist())
    with pytest.raises(DataError, match="no validation windows"):
        make_eval_batches(arange_data(tmp_path, 5 * SEQ + 1), batch_size=4, num_batches=1)


def test_test_sequences_of_text_is_every_window(corpus, tmp_path):
    cfg, tok, _ = corpus
    text = "\n".join(f"line {i}: the quick brown fox" for i in range(200))
    (tmp_path / "test.txt").write_text(text)
    source, info = test_sequences(cfg, tok, str(tmp_path / "test.txt"))
    ids = [*tok.encode(text), tok.eos_id]
    assert info == {"sequences": (len(ids) - 1) // cfg.seq_len} and len(source) == info["sequences"]
    np.testing.assert_array_equal(source[1]["inputs"], ids[cfg.seq_len:2 * cfg.seq_len])
