"""Length buckets (`jaxtune.data.buckets`): the ladder of lengths, and that a cut drops padding only."""

from __future__ import annotations

import numpy as np
import pytest

from jaxtune.data.buckets import MIN_BUCKET, bucket_length, cut, longest_row, real_tokens


def test_the_ladder_has_per_octave_lengths_and_bounded_padding():
    assert [bucket_length(n, 128, 4) for n in (1, 16, 17, 33, 64, 65, 101, 127, 128, 500)] == \
        [16, 16, 20, 40, 64, 80, 112, 128, 128, 128]
    assert [bucket_length(n, 2048, 4) for n in (129, 300, 513, 1000, 1500, 2047)] == [160, 320, 640, 1024, 1536, 2048]
    assert bucket_length(101, 128, 0) == 128 == bucket_length(3, 128, 0)  # off: always the cap
    for per_octave in (1, 2, 4, 8):
        lengths = {bucket_length(n, 4096, per_octave) for n in range(1, 4097)}
        assert len({b for b in lengths if 256 < b <= 512}) == per_octave  # so many programs per doubling, at most
        for n in range(MIN_BUCKET, 4097):
            b = bucket_length(n, 4096, per_octave)
            assert n <= b <= 4096 and (b - n) < n / per_octave + 1  # padding past the longest row < 1/per_octave


def test_a_cut_keeps_every_real_token():
    rng = np.random.default_rng(0)
    seg = np.zeros((3, 2, 64), np.int32)
    for b, lengths in enumerate([(10, 30), (5, 41), (22, 7)]):
        for side, n in enumerate(lengths):
            seg[b, side, :n] = 1
    batch = {"inputs": rng.integers(1, 100, seg.shape).astype(np.int32) * seg, "segment_ids": seg,
             "loss_mask": seg.astype(np.float32), "ref_logps": rng.standard_normal((3, 2)).astype(np.float32)}
    assert longest_row(batch) == 41 and real_tokens(batch) == 115
    short = cut(batch, bucket_length(longest_row(batch), 64, 4), ("inputs", "segment_ids", "loss_mask"))
    assert short["inputs"].shape == (3, 2, 48) and short["ref_logps"] is batch["ref_logps"]
    assert real_tokens(short) == 115 and np.array_equal(short["inputs"], batch["inputs"][..., :48])
    assert not batch["segment_ids"][..., 48:].any()
    assert longest_row({"segment_ids": np.zeros((2, 8), np.int32)}) == 1  # an all-padding batch


def test_windows_count_every_position():
    assert real_tokens({"inputs": np.zeros((4, 32), np.int32), "targets": np.zeros((4, 32), np.int32)}) == 128


@pytest.mark.parametrize("bad", [0, -3])
def test_no_buckets_below_one_per_octave(bad):
    assert bucket_length(7, 100, bad) == 100
