import json
import math
import multiprocessing

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
)
from jaxtune.data import tokens as tokens_module

SEQ = 4  # window length of the synthetic streams below


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(data_cfg, tokenizer, TokenData) for 100 kB of stdlib, small vocab, seq_len 32."""
    cfg = DataConfig(max_bytes=100_000, seq_len=32, val_fraction=0.1, cache_dir=str(tmp_path_factory.mktemp("cache")))
    tok = load_tokenizer(TokenizerConfig(vocab_size=512, train_bytes=100_000), cfg)
    return cfg, tok, prepare_tokens(cfg, tok)


def arange_data(tmp_path, train_windows, val_windows=0):
    """A TokenData whose token k is k, so a window's first input says which window it is (k // SEQ)."""
    n = train_windows * SEQ + 1 + (val_windows * SEQ + 1 if val_windows else 0)
    path = tmp_path / "arange.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", shape=(n,))
    return TokenData(tokens=tokens, seq_len=SEQ, train_windows=train_windows, val_windows=val_windows, path=path)


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
    total = (n - 1) // T
    assert data.val_windows == math.ceil(0.1 * total) and data.train_windows >= total - data.val_windows - 1
    last_train_target = (data.train_windows - 1) * T + T  # index of the last token a training window uses
    assert data.val_start > last_train_target
    assert data.val_start + data.val_windows * T + 1 <= n
    it = make_train_iterator(data, global_batch=8, seed=0)
    for batch in take(it, 3):
        assert batch["inputs"].shape == batch["targets"].shape == (8, T) and batch["inputs"].dtype == np.int32
        for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
            starts = [
                i * T for i in range(data.train_windows) if np.array_equal(data.tokens[i * T : i * T + T], inputs)
            ]
            assert starts, "a training row is not a window of the token stream"
            np.testing.assert_array_equal(targets, data.tokens[starts[0] + 1 : starts[0] + T + 1])
    it.close()
    (val,) = make_eval_batches(data, batch_size=4, num_batches=1)
    np.testing.assert_array_equal(val["inputs"][1], data.tokens[data.val_start + T : data.val_start + 2 * T])
    np.testing.assert_array_equal(val["targets"][1], data.tokens[data.val_start + T + 1 : data.val_start + 2 * T + 1])


@pytest.mark.parametrize("num_tokens", [41, 42, 44, 45, 9, 6])
def test_split_keeps_every_window_inside_the_stream_and_apart(num_tokens):
    train, val = tokens_module._split(num_tokens, 4, 0.2)
    total = (num_tokens - 1) // 4
    assert val == math.ceil(0.2 * total)
    assert train * 4 + 1 + val * 4 + 1 <= num_tokens  # both splits fit, one token apart
    assert train + val >= total - 1  # and at most the one window is lost to that gap


def test_too_few_tokens_for_seq_len(corpus):
    cfg, tok, data = corpus
    with pytest.raises(
        DataError, match=rf"data.seq_len=100000 leaves no training window: .* {len(data.tokens)} tokens"
    ):
        prepare_tokens(cfg.model_copy(update={"seq_len": 100_000}), tok)


# --- training iterator -------------------------------------------------------------------------------------


def test_order_is_a_function_of_seed_and_covers_each_epoch(tmp_path):
    data = arange_data(tmp_path, train_windows=40)
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
    data = arange_data(tmp_path, train_windows=10)  # 7 + 5 batches of 3 cross epoch boundaries
    it = make_train_iterator(data, global_batch=3, seed=5)
    take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    expected = take(it, 5)
    fresh = make_train_iterator(data, global_batch=3, seed=5)
    fresh.set_state(state)
    assert_same(take(fresh, 5), expected)


def test_processes_interleave_to_the_global_batch(tmp_path):
    data = arange_data(tmp_path, train_windows=13)
    whole = take(make_train_iterator(data, global_batch=4, seed=3), 8)
    p0 = take(make_train_iterator(data, global_batch=4, seed=3, process_index=0, process_count=2), 8)
    p1 = take(make_train_iterator(data, global_batch=4, seed=3, process_index=1, process_count=2), 8)
    for g, a, b in zip(whole, p0, p1, strict=True):
        assert a["inputs"].shape == (2, SEQ)
        np.testing.assert_array_equal(g["inputs"][0::2], a["inputs"])
        np.testing.assert_array_equal(g["inputs"][1::2], b["inputs"])
    with pytest.raises(DataError, match="train.batch_size=5 does not split over 2 processes"):
        make_train_iterator(data, global_batch=5, seed=0, process_count=2)


def test_worker_processes_give_the_same_batches(tmp_path):
    if "spawn" not in multiprocessing.get_all_start_methods():
        pytest.skip("grain workers need the spawn start method")
    data = arange_data(tmp_path, train_windows=20)
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


def test_eval_batches_are_the_validation_windows_in_order(tmp_path):
    data = arange_data(tmp_path, train_windows=5, val_windows=10)
    batches = make_eval_batches(data, batch_size=4, num_batches=8)
    assert len(batches) == 2  # only two full batches fit in 10 windows
    first_inputs = [int(x) for b in batches for x in b["inputs"][:, 0]]
    assert first_inputs == [data.val_start + i * SEQ for i in range(8)]
    for b in batches:
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    p1 = make_eval_batches(data, batch_size=4, num_batches=8, process_index=1, process_count=2)
    np.testing.assert_array_equal(p1[1]["inputs"], batches[1]["inputs"][1::2])
    # A split smaller than one batch still gives one full batch, cycling through the windows.
    (small,) = make_eval_batches(data, batch_size=16, num_batches=2)
    assert [int(x) for x in small["inputs"][:, 0]] == [data.val_start + (i % 10) * SEQ for i in range(16)]
    with pytest.raises(DataError, match="no validation windows"):
        make_eval_batches(arange_data(tmp_path, train_windows=5), batch_size=4, num_batches=1)
