"""Kinds jaxtune knows, each declared once: batch kinds (what rows a data format makes, what the train step takes,
what an evaluation reports), the native model families and the GGUF export types (the objectives' records stand beside
their keys, in `jaxtune.config.objective`). The config's ``Literal`` types are made from these records, and the
pipeline (`jaxtune.data.pipeline`), the TPU plan (`jaxtune.aot`), evaluation and the step's metrics ask a record
instead of comparing names. Nothing here imports JAX: the CLI reads it before JAX starts.

Adding a kind is one record here plus its implementation in the room that owns it (`docs/architecture.md`, "Where
to touch").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

# The arrays of a training row, each (..., T): token ids and next-token targets; fine-tuning rows add the positions
# (restarting per packed example), the segment ids that keep packed examples apart, and the loss mask.
WINDOW_KEYS = ("inputs", "targets")
ROW_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")

HeldOut = Literal["loss", "pairs", "answers"]


@dataclass(frozen=True)
class BatchKind:
    """One kind of training batch.

    ``formats``: the ``data.format`` values read as this kind (the first is its canonical one). ``row_keys``: the
    arrays the step takes, each shaped (*rows, T) int32 (``loss_mask`` float32). ``sequences``: sequences per item of
    the data (a pretraining window or an SFT row is 1, a preference pair 2; ``None``: the objective's
    ``num_generations`` completions of each prompt). ``item_axis``: the item's sequences keep an axis of their own,
    (B, 2, T) pairs, instead of being flattened to (B * sequences, T) rows. ``extra_keys(objective)``: float32 arrays
    shaped like the rows without T (``advantages`` (B * G,), precomputed ``ref_logps`` (B, 2)). ``held_out``: what an
    evaluation reports: ``loss`` (held-out loss and perplexity), ``pairs`` (the objective's loss and reward metrics
    on held-out pairs, against a reference: never a perplexity) or ``answers`` (held-out prompts answered and scored
    by the reward functions; there is no fixed text to score). ``generates``: the loop samples the completions
    itself before each step, from prompts of at most ``data.seq_len - max_completion_length`` tokens."""

    name: str
    formats: tuple[str, ...]
    description: str
    row_keys: tuple[str, ...] = ROW_KEYS
    sequences: int | None = 1
    item_axis: bool = False
    extra_keys: Callable[[Any], tuple[str, ...]] = field(default=lambda objective: ())
    held_out: HeldOut = "loss"
    generates: bool = False

    def sequences_per_item(self, objective: Any) -> int:
        return objective.num_generations if self.sequences is None else self.sequences

    def rows(self, items: int, objective: Any) -> tuple[int, ...]:
        """The leading dims of the step's arrays for ``items`` items of data (pairs, prompts, windows)."""
        n = self.sequences_per_item(objective)
        return (items, n) if self.item_axis else (items * n,)

    def step_arrays(self, items: int, seq_len: int, objective: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, dtype name)} of the batch the train step takes for ``items`` items."""
        rows = self.rows(items, objective)
        out = {k: ((*rows, seq_len), "float32" if k == "loss_mask" else "int32") for k in self.row_keys}
        out.update({k: (rows, "float32") for k in self.extra_keys(objective)})
        return out


WINDOWS = BatchKind(
    "windows", ("text", "tokens"), "pretraining text cut into windows of one token stream (text tokenized here, or "
    "token ids made elsewhere)", row_keys=WINDOW_KEYS)
ROWS = BatchKind(
    "rows", ("messages", "sharegpt", "alpaca", "prompt_completion"), "fine-tuning rows (chat or instruction), "
    "packed into sequences, loss on the tokens data.loss_on names")
PAIRS = BatchKind(
    "pairs", ("preference",), "preference pairs: a prompt with a chosen and a rejected completion, one pair per "
    "item (never packed)", sequences=2, item_axis=True, held_out="pairs",
    extra_keys=lambda obj: ("ref_logps",) if obj.uses_reference and obj.precompute_ref_logps else ())
PROMPTS = BatchKind(
    "prompts", ("prompts",), "prompts with their answer fields; the loop samples num_generations completions of each",
    sequences=None, held_out="answers", generates=True, extra_keys=lambda obj: ("advantages",))

BATCH_KINDS: dict[str, BatchKind] = {k.name: k for k in (WINDOWS, ROWS, PAIRS, PROMPTS)}
KIND_OF_FORMAT: dict[str, BatchKind] = {f: k for k in BATCH_KINDS.values() for f in k.formats}
FORMATS = tuple(KIND_OF_FORMAT)  # data.format's values
PRETOKENIZED_FORMAT = "tokens"  # the WINDOWS format whose sources are token ids already


# The native model families (`jaxtune.models.registry.FAMILIES` holds each one's implementation, keyed by these).
FAMILY_NAMES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma3")

# GGUF tensor types an export writes (`jaxtune.models.gguf_export`): matrices in this type, norms and biases f32.
GGUF_TYPES = ("f16", "bf16", "q8_0", "f32")
