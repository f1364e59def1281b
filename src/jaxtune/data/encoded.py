"""Encoded rows as every row-based format keeps them: one row's token ids and loss mask (`Encoded`, what
`jaxtune.data.sft.Encoder` makes), rows concatenated into flat arrays (`Examples`), and bins of rows laid out one
after another in fixed-length sequences with segment ids and positions (`PackedRows`, the Grain source SFT packs
into and preference pairs place one sequence per bin in)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
