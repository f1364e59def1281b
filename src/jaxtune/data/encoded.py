"""Encoded rows as every row-based format keeps them: one row's token ids and loss mask (`Encoded`, what
`jaxtune.data.sft.Encoder` makes), rows concatenated into flat arrays (`Examples`), and bins of rows laid out one
after another in fixed-length sequences with segment ids and positions (`PackedRows`, the Grain source SFT packs
into and preference pairs place one sequence per bin in)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxtune.config.kinds import BRANCH_KEY, BRANCH_SLOTS_KEY
from jaxtune.data.formats import Example


@dataclass
class Encoded:
    ids: np.ndarray  # int32 (n,)
    mask: np.ndarray  # bool (n,): token j is a trained target
    example: Example | None = None  # the row it encodes; None once truncated (its reply is cut)


@dataclass
class Examples:
    """Encoded rows, concatenated: row ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` (and ``mask``)."""

    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, rows: list[Encoded]) -> Examples:
        lengths = np.array([len(r.ids) for r in rows], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cat = (lambda xs, dt: np.concatenate(xs).astype(dt)) if rows else (lambda xs, dt: np.zeros(0, dt))
        return cls(cat([r.ids for r in rows], np.int32), cat([r.mask for r in rows], bool), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.mask[a:b]

    @property
    def positions_used(self) -> np.ndarray:
        """Sequence positions each row fills: its length minus one."""
        return np.diff(self.offsets) - 1


class PackedRows:
    """Grain random-access source: sequence ``[r]`` is {"inputs", "targets", "positions", "segment_ids"}: int32
    (T,) and "loss_mask": float32 (T,), the rows of bin ``r`` one after another, then padding (segment 0)."""

    def __init__(self, examples: Examples, bins: list[list[int]], seq_len: int):
        self.examples, self.bins, self.seq_len = examples, bins, seq_len

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, r: int) -> dict[str, np.ndarray]:
        t = self.seq_len
        out = {k: np.zeros(t, np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
        out["loss_mask"] = np.zeros(t, np.float32)
        pos = 0
        for seg, i in enumerate(self.bins[r], 1):
            ids, mask = self.examples.row(i)
            n = len(ids) - 1
            out["inputs"][pos:pos + n] = ids[:-1]
            out["targets"][pos:pos + n] = ids[1:]
            out["loss_mask"][pos:pos + n] = mask[1:]
            out["positions"][pos:pos + n] = np.arange(n)
            out["segment_ids"][pos:pos + n] = seg
            pos += n
        return out


def shared_row(sequences: list[tuple[np.ndarray, np.ndarray]], prompt: int, length: int,
               values: dict[str, list[np.ndarray]] | None = None,
               regions: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Sequences (ids, loss mask) that start with the same ``prompt`` tokens, as one row of ``length`` positions: the
    prompt's positions once (branch 0), then each sequence's own (branch k = 1, 2, ...), then padding (segment 0).

    A sequence of n tokens fills positions 0..n-2 (inputs ids[:-1], targets ids[1:]). The prompt's last token (of P)
    predicts each completion's first, so every branch starts
    there: the row holds positions 0..P-2 once, and each branch its positions P-1..n-2 with the same position
    numbers, inputs, targets and loss as its own row would have. Under the branch mask
    (`jaxtune.models.layers.attention_mask`) each position sees exactly what it sees in its own row, so the
    log-probs are the separate rows' (to float rounding). ``values``: {key: per sequence, a float per token like its
    ids}, placed at the positions whose target that token is, like the loss mask (0 elsewhere).

    ``regions`` (P, C): the row in regions instead (`jaxtune.models.layers.RegionMask`), ``length`` = P + G C: the
    prompt's positions in slots 0.., each sequence's own from slot P + (k - 1) C, and ``branch_slots`` (G, C), the
    branch's number where its slot holds a token."""
    values = values or {}
    out = {k: np.zeros(length, np.int32) for k in ("inputs", "targets", "positions", "segment_ids", BRANCH_KEY)}
    out.update({k: np.zeros(length, np.float32) for k in ("loss_mask", *values)})
    start = max(prompt - 1, 0)  # the first position that belongs to a branch

    def put(at: int, i: int, lo: int, hi: int, branch: int) -> int:
        ids, mask = sequences[i]
        n = hi - lo
        out["inputs"][at:at + n] = ids[lo:hi]
        out["targets"][at:at + n] = ids[lo + 1:hi + 1]
        out["loss_mask"][at:at + n] = mask[lo + 1:hi + 1]
        for k, per_sequence in values.items():
            out[k][at:at + n] = per_sequence[i][lo + 1:hi + 1]
        out["positions"][at:at + n] = np.arange(lo, hi)
        out["segment_ids"][at:at + n] = 1
        out[BRANCH_KEY][at:at + n] = branch
        return at + n

    at = put(0, 0, 0, start, 0)
    if regions is not None:
        slots, width = regions
        out[BRANCH_SLOTS_KEY] = np.zeros((len(sequences), width), np.int32)
    for branch, (ids, _) in enumerate(sequences, 1):
        if regions is not None:
            at = slots + (branch - 1) * width
            out[BRANCH_SLOTS_KEY][branch - 1, :len(ids) - 1 - start] = branch
        at = put(at, branch - 1, start, len(ids) - 1, branch)
    return out
