"""Tight batches: a batch of right-padded rows cut to a length bucket that holds its longest row, instead of
``data.seq_len``.

Rows of fine-tuning data, preference pairs and GRPO's completions are right-padded (``segment_ids`` 0 after the last
real token). Padding costs the step as much as a real token, so a batch whose rows are short is cut to the smallest
*bucket* that holds its longest row. The buckets are ``data.length_buckets`` lengths per doubling (4: 64, 80, 96,
112, 128, 160, ...), at least `MIN_BUCKET` and at most ``data.seq_len``, so a run compiles one program per bucket its
batches fall in (a handful) and the padding past the longest row stays under 1 / ``length_buckets`` of it. The cut
drops only padding: the model sees the same tokens at the same positions, and the causal mask keeps them blind to
what follows, so the losses are those of the full-length batch (to float rounding of the shorter shapes). A batch's
bucket is a function of its rows alone, so a resumed run cuts every batch as the uninterrupted run did.
"""

from __future__ import annotations

import numpy as np

from jaxtune.config.kinds import BRANCH_SLOTS_KEY

MIN_BUCKET = 16


def bucket_length(longest: int, cap: int, per_octave: int) -> int:
    """The smallest bucket >= ``longest`` (at most ``cap``): ``per_octave`` evenly spaced lengths in each doubling
    above `MIN_BUCKET`; ``per_octave`` 0: always ``cap``."""
    if per_octave <= 0 or longest >= cap:
        return cap
    length = max(int(longest), MIN_BUCKET)
    octave = 1 << (length - 1).bit_length() - 1  # the power of two at or below length - 1 (length > octave)
    step = max(octave // per_octave, 1)
    return min(cap, -(-length // step) * step)


def longest_row(batch: dict[str, np.ndarray]) -> int:
    """The positions a batch of right-padded rows needs: one past its last real token (``segment_ids`` > 0)."""
    real = np.asarray(batch["segment_ids"]).reshape(-1, batch["segment_ids"].shape[-1]) > 0
    used = real.any(axis=0)
    return int(np.flatnonzero(used)[-1]) + 1 if used.any() else 1


def real_tokens(batch: dict[str, np.ndarray]) -> int:
    """The tokens that are not padding: ``segment_ids`` > 0 (every position of a batch without segment ids)."""
    if "segment_ids" in batch:
        return int(np.count_nonzero(batch["segment_ids"]))
    return int(np.asarray(batch["inputs"]).size)


def cut(batch: dict[str, np.ndarray], length: int, row_keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The batch with its ``row_keys`` arrays, (..., T), cut to their first ``length`` positions."""
    return {k: np.ascontiguousarray(v[..., :length]) if k in row_keys else v for k, v in batch.items()}


def cut_regions(batch: dict[str, np.ndarray], regions: tuple[int, int, int], widths: tuple[int, int],
                row_keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Rows in regions (`jaxtune.models.layers.RegionMask`), (..., P + G C) with ``regions`` (P, G, C), cut to
    ``widths`` (p, c): the prompt's first p slots, then each completion's first c (``branch_slots`` (..., G, C) to
    (..., G, c)). Only padding goes: each region is right-padded."""
    p, g, c = regions
    keep_p, keep_c = widths

    def rows(v: np.ndarray) -> np.ndarray:
        lead = v.shape[:-1]
        completions = v[..., p:].reshape(*lead, g, c)[..., :keep_c].reshape(*lead, g * keep_c)
        return np.concatenate([v[..., :keep_p], completions], -1)

    out = {k: rows(v) if k in row_keys else v for k, v in batch.items()}
    out[BRANCH_SLOTS_KEY] = np.ascontiguousarray(batch[BRANCH_SLOTS_KEY][..., :keep_c])
    return out
