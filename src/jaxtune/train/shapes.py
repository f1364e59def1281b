"""The shape each batch is stepped at (`BatchShapes`): its length bucket (`jaxtune.data.buckets`) agreed by every
process, the real tokens in it, and a line when a length is met for the first time (its train step compiles then).

With a ``context`` mesh axis (``mesh.context`` > 1) a batch whose length the axis does not divide is not split over
it: each device of a context group runs the rows whole (correct, but with a whole row's memory and time). That is
said, not silent: at start, the length buckets up to ``data.seq_len`` the axis does not divide (`context_notes`);
the first time a batch of such a length is stepped, a warning with its rows; and at the end the rows run whole out
of all (`whole_note`, also in summary.json).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtune.config import Config
from jaxtune.config.kinds import BRANCH_SLOTS_KEY
from jaxtune.data.buckets import bucket_length, cut, cut_regions, longest_row, real_tokens
from jaxtune.train.ahead import Ahead


def train_key(shape: Shape) -> tuple:
    """The key the train step's program for ``shape`` is compiled ahead under (`jaxtune.train.ahead`)."""
    return ("train", shape.program)


@dataclass(frozen=True)
class Shape:
    """A global batch as stepped: its ``length`` (positions per row), its ``tokens`` that are not padding and its
    ``positions`` (rows x length): the step's real and padded work."""

    length: int
    tokens: int
    positions: int
    # rows in regions (`BatchShapes.regions`): the prompt's slots and each completion's, which the program is
    # compiled for (two cuts may sum to the same length)
    regions: tuple[int, int] | None = None

    @property
    def program(self) -> int | tuple[int, int]:
        """What the train step compiles one program per: the length, or the regions' two widths."""
        return self.length if self.regions is None else self.regions

    @property
    def pad_fraction(self) -> float:
        return 1.0 - self.tokens / max(self.positions, 1)


@dataclass
class BatchShapes:
    """Cuts the batches of a kind with buckets (fine-tuning rows, pairs, GRPO's completions) to their length
    bucket, ``data.length_buckets`` per doubling up to ``data.seq_len``; pretraining windows keep theirs. With
    several processes each holds some rows of the global batch, so the longest row and the token counts are
    gathered from all of them (one small exchange per batch) and every process cuts to the same length."""

    cap: int
    per_octave: int
    row_keys: tuple[str, ...]
    lengths: set = field(default_factory=set)  # the programs (`Shape.program`) the train step has met
    # (P, G, C) of rows in regions (`BatchKind.regions`): the prompt's P slots and each completion's C are cut to
    # their own buckets (the longest prompt's, the longest completion's)
    regions: tuple[int, int, int] | None = None
    context: int = 1  # the mesh's context axis: a batch whose length it does not divide runs its rows whole
    rows: int = 0  # the rows stepped, and of them those run whole (not split over the context axis)
    whole_rows: int = 0

    @classmethod
    def of(cls, cfg: Config, context: int = 1) -> BatchShapes:
        data, kind = cfg.data, cfg.data.kind
        n = kind.sequences_per_item(cfg.objective)
        regions = kind.regions(data.seq_len, cfg.objective, data.shares_prompts)
        if regions is not None:
            regions = (regions[0], n, regions[1])
        cap = data.seq_len * (n if data.shares_prompts else 1) if regions is None else regions[0] + n * regions[2]
        return cls(cap, data.length_buckets if kind.buckets else 0, kind.step_keys(data.shares_prompts),
                   regions=regions, context=context)

    def context_notes(self) -> list[str]:
        """A warning at start when the context axis does not divide some of the lengths batches may be cut to (the
        buckets up to ``cap``; with regions, the prompt's and completions' widths are said at run time only)."""
        if self.context <= 1 or self.regions is not None:
            return []
        lengths = sorted({bucket_length(n, self.cap, self.per_octave) for n in range(1, self.cap + 1)})
        odd = [n for n in lengths if n % self.context]
        if not odd:
            return []
        shown = ", ".join(map(str, odd[:6])) + (", ..." if len(odd) > 6 else "")
        return [(f"warning: mesh.context={self.context} does not divide {len(odd)} of the {len(lengths)} lengths a "
                 f"batch may be cut to ({shown}): a batch of such a length runs each row whole on every device of "
                 "the context group (correct, not split; said when met, counted at the end); a data.seq_len that "
                 f"divides by {self.context} and longer rows avoid it")]

    def whole_note(self) -> str | None:
        """At the end: how many of the rows stepped ran whole (not split over the context axis); None without one."""
        if self.context <= 1:
            return None
        return (f"mesh.context={self.context}: {self.whole_rows} of the {self.rows} rows stepped ran whole (their "
                f"batch's length did not divide by {self.context})")

    def fit(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Shape]:
        """This process's rows cut to the global batch's bucket, and the global batch's `Shape`."""
        rows = int(np.prod(np.shape(batch["inputs"])[:-1]))
        prompt = self.regions[0] if self.regions else None
        longest = longest_row({"segment_ids": batch["segment_ids"][..., :prompt]}) if self.per_octave else self.cap
        completion = int(np.max(np.sum(batch[BRANCH_SLOTS_KEY] > 0, -1), initial=1)) if self.regions else 0
        local = np.array([longest, completion, real_tokens(batch), rows], np.int64)
        if jax.process_count() > 1 and (self.per_octave or "segment_ids" in batch):  # windows: all real, all alike
            every = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 4)
            local = np.array([every[:, 0].max(), every[:, 1].max(), every[:, 2].sum(), every[:, 3].sum()])
        else:
            local = local * np.array([1, 1, jax.process_count(), jax.process_count()])
        longest, completion, tokens, rows = (int(x) for x in local)
        if self.regions:
            p, g, c = self.regions
            widths = (bucket_length(longest, p, self.per_octave), bucket_length(completion, c, self.per_octave))
            length = widths[0] + g * widths[1]
            cut_batch = cut_regions(batch, self.regions, widths, self.row_keys) if length < self.cap else batch
            return cut_batch, Shape(length, tokens, rows * length, widths)
        length = bucket_length(longest, self.cap, self.per_octave)
        return (cut(batch, length, self.row_keys) if length < self.cap else batch), Shape(length, tokens,
                                                                                          rows * length)

    def step(self, train: Callable[[], Any], shape: Shape, step: int, say: Callable[[str], None],
             ahead: Ahead | None = None) -> Any:
        """``train()`` (the step's dispatch), saying so when ``shape``'s length is new: its program compiles (or is
        read from the compilation cache) before the dispatch returns, or was compiled ahead (``ahead``: waited for
        here, if still compiling)."""
        rows = shape.positions // max(shape.length, 1)
        self.rows += rows
        whole = self.context > 1 and shape.length % self.context != 0
        self.whole_rows += rows if whole else 0
        if shape.program in self.lengths:
            return train()
        self.lengths.add(shape.program)
        if whole:
            say(f"warning: step {step}: batches of {shape.length} positions do not divide by mesh.context="
                f"{self.context}, so their {rows} rows run whole on each device of the context group (not split)")
        split = "" if shape.regions is None else (f" (a prompt's {shape.regions[0]} slots, then "
                                                   f"{self.regions[1]} completions of {shape.regions[1]})")
        if ahead is not None and ahead.has(train_key(shape)):
            started = time.perf_counter()
            compiled = ahead.wait(train_key(shape))
            ahead.release()  # the later buckets' programs, now that the first step's is made
            waited = time.perf_counter() - started
            say(f"step {step}: the train step for batches of {shape.length} positions{split} was compiled ahead "
                f"({compiled}" + (f"; waited {waited:.1f} s for it)" if waited >= 0.1 else ")"))
            return train()
        say(f"step {step}: compiling the train step for batches of {shape.length} positions{split} ...")
        started = time.perf_counter()
        out = train()
        say(f"step {step}: compiled in {time.perf_counter() - started:.1f} s")
        return out
