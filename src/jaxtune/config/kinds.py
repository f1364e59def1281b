"""Every kind jaxtune knows, each declared once: batch kinds (what rows a data format makes, what the train step
takes, what an evaluation reports), objectives (the batch kinds they train on, their loss types, companion and
completions; each one's keys and defaults are its section class in `jaxtune.config.objectives`), the native model
families and the GGUF export types. The config's ``Literal`` types are made from these records, and the pipeline
(`jaxtune.data.pipeline`), the TPU plan (`jaxtune.aot`), evaluation and the step's metrics ask a record instead of
comparing names. Nothing here imports JAX: the CLI reads it before JAX starts.

Adding a kind is one record here (an objective's section class too, in `jaxtune.config.objectives`) plus its
implementation in the room that owns it (`docs/architecture.md`, "Where to touch").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

# The arrays of a training row, each (..., T): token ids and next-token targets; fine-tuning rows add the positions
# (restarting per packed example), the segment ids that keep packed examples apart, and the loss mask.
WINDOW_KEYS = ("inputs", "targets")
ROW_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
BRANCH_KEY = "branch_ids"  # rows that share a prompt: 0 the prompt, k the k-th sequence's completion
# Sampled completions' shared rows are laid out in regions (the prompt, then each completion in C slots of its own):
# (B, G, C), k where the k-th completion's slot holds a token (`jaxtune.models.layers.RegionMask`).
BRANCH_SLOTS_KEY = "branch_slots"
# Sampled completions' rows add, at each completion target, its log-prob under the distribution the sampler drew it
# from (0 elsewhere): GRPO compares them with the trainer's and may use them as the old log-probs.
SAMPLER_LOGPS_KEY = "sampler_logps"
FLOAT_ROW_KEYS = ("loss_mask", SAMPLER_LOGPS_KEY)  # the row arrays that are float32 (the others are int32 ids)

HeldOut = Literal["loss", "pairs", "rewards", "answers"]
REFERENCE_HELD_OUT = ("pairs", "rewards")  # held-out reports of the objective's loss and rewards (no perplexity)


@dataclass(frozen=True)
class BatchKind:
    """One kind of training batch.

    ``formats``: the ``data.format`` values read as this kind (the first is its canonical one). ``row_keys``: the
    arrays the step takes, each shaped (*rows, T) int32 (`FLOAT_ROW_KEYS` float32). ``sequences``: sequences per item of
    the data (a pretraining window or an SFT row is 1, a preference pair 2; ``None``: the objective's
    ``num_generations`` completions of each prompt). ``item_axis``: the item's sequences keep an axis of their own,
    (B, 2, T) pairs, instead of being flattened to (B * sequences, T) rows. ``extra_keys(objective)``: float32 arrays
    shaped like the rows without T (``advantages`` (B * G,), precomputed ``ref_logps`` (B, 2)). ``held_out``: what an
    evaluation reports: ``loss`` (held-out loss and perplexity), ``pairs`` (the objective's loss and reward metrics
    on held-out pairs, against a reference: never a perplexity), ``rewards`` (the same without pairs to rank: the
    rewards of desirable and undesirable rows) or ``answers`` (held-out prompts answered and scored
    by the reward functions; there is no fixed text to score). ``generates``: the loop samples the completions
    itself before each step, from prompts of at most ``data.seq_len - max_completion_length`` tokens. ``buckets``:
    its rows are right-padded, so each batch is cut to a length bucket that holds its longest row
    (`jaxtune.data.buckets`, ``data.length_buckets``); pretraining windows are all real tokens. ``shares_prompt``: the
    item's sequences start with one prompt, so with ``data.share_prompts`` the item is one row (no item axis) that
    holds the prompt once, then each sequence's completion with ``branch_ids`` 1, 2, ... (the prompt's 0): a
    completion's tokens attend to the prompt and to their own branch, their positions continue the prompt's
    (`jaxtune.data.encoded.shared_row`), of at most ``sequences x seq_len`` positions; its extra arrays are then
    (B, sequences), one value per sequence with the items' axis first (micro-batches split items, never a group)."""

    name: str
    formats: tuple[str, ...]
    description: str
    row_keys: tuple[str, ...] = ROW_KEYS
    sequences: int | None = 1
    item_axis: bool = False
    extra_keys: Callable[[Any], tuple[str, ...]] = field(default=lambda objective: ())
    held_out: HeldOut = "loss"
    generates: bool = False
    buckets: bool = True
    unit: str = "tokens"  # what a held-out loss averages over (tokens with loss, pairs)
    shares_prompt: bool = False
    shares_prompt_by_default: bool = False  # where ``data.share_prompts`` is unset: measured faster (benchmarks/)
    prompted: bool = False  # its rows keep the prompt apart from the completion (``data.max_prompt_length`` applies)
    scored_only: int = 0  # sequences per item that only run forward, without gradient (KTO's KL row)

    def trained_per_item(self, objective: Any) -> int:
        """Sequences per item the step trains on (what model FLOPs and tokens/s count)."""
        return self.sequences_per_item(objective) - self.scored_only

    def trained_positions(self, items: int, seq_len: int, objective: Any, shared: bool = False) -> int:
        """Positions the step trains on for ``items`` items at ``seq_len``: every trained sequence's, or with
        ``shared`` each shared row's (the prompt once), what the step computes (model FLOPs, tokens/s, MFU)."""
        if not shared:
            return items * self.trained_per_item(objective) * seq_len
        rows_and_length = self.step_arrays(items, seq_len, objective, shared)["inputs"][0]
        return math.prod(rows_and_length)

    def sequences_per_item(self, objective: Any) -> int:
        return objective.num_generations if self.sequences is None else self.sequences

    def rows(self, items: int, objective: Any, shared: bool = False) -> tuple[int, ...]:
        """The leading dims of the step's arrays for ``items`` items of data (pairs, prompts, windows); ``shared``:
        laid out with their prompt shared (one row per item)."""
        n = self.sequences_per_item(objective)
        return (items,) if shared else (items, n) if self.item_axis else (items * n,)

    def regions(self, seq_len: int, objective: Any, shared: bool = False) -> tuple[int, int] | None:
        """(P, C) where the step's shared rows are laid out in regions, a prompt of P slots then each completion in
        C of its own (`jaxtune.models.layers.RegionMask`): sampled completions (``generates``), whose length is
        capped by ``max_completion_length``; None for rows packed one branch after the other (pairs). The widest
        layout: a batch is cut to its longest prompt's and longest completion's buckets
        (`jaxtune.train.shapes.BatchShapes`)."""
        if not (shared and self.generates):
            return None
        width = objective.max_completion_length
        return seq_len - width, width

    def step_keys(self, shared: bool = False) -> tuple[str, ...]:
        """The row arrays of the step's batch; a shared prompt's rows add ``branch_ids``."""
        return (*self.row_keys, BRANCH_KEY) if shared else self.row_keys

    def step_arrays(self, items: int, seq_len: int, objective: Any,
                    shared: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
        """{key: (shape, dtype name)} of the batch the train step takes for ``items`` items of ``seq_len``-position
        rows (``shared``: rows of the item's prompt once and its completions, ``sequences x seq_len`` positions)."""
        rows, n = self.rows(items, objective, shared), self.sequences_per_item(objective)
        regions = self.regions(seq_len, objective, shared)
        length = seq_len if not shared else seq_len * n if regions is None else regions[0] + n * regions[1]
        out = {k: ((*rows, length), "float32" if k in FLOAT_ROW_KEYS else "int32") for k in self.step_keys(shared)}
        extra_rows = (items, n) if shared else self.rows(items, objective)
        out.update({k: (extra_rows, "float32") for k in self.extra_keys(objective)})
        if regions is not None:
            out[BRANCH_SLOTS_KEY] = ((items, n, regions[1]), "int32")
        return out


WINDOWS = BatchKind(
    "windows", ("text", "tokens"), "pretraining text cut into windows of one token stream (text tokenized here, or "
    "token ids made elsewhere)", row_keys=WINDOW_KEYS, buckets=False)
ROWS = BatchKind(
    "rows", ("messages", "sharegpt", "alpaca", "prompt_completion"), "fine-tuning rows (chat or instruction), "
    "packed into sequences, loss on the tokens data.loss_on names")
PAIRS = BatchKind(
    "pairs", ("preference",), "preference pairs: a prompt with a chosen and a rejected completion, one pair per "
    "item (never packed)", sequences=2, item_axis=True, held_out="pairs", unit="pairs", shares_prompt=True,
    prompted=True,
    shares_prompt_by_default=True,
    extra_keys=lambda obj: (("ref_logps",) if obj.precomputed_reference else ()) + (("margin",) if obj.spec.margins
                                                                                       else ()))
UNPAIRED = BatchKind(
    "unpaired", ("unpaired",), "unpaired preference rows: a prompt, one completion and whether it is desirable; "
    "each item the row and its KL row (its prompt with another row's completion), never packed",
    sequences=2, item_axis=True, held_out="rewards", unit="rows", prompted=True,
    extra_keys=lambda obj: ("labels",) + (("ref_logps",) if obj.precomputed_reference else ()),
    scored_only=1)
PROMPTS = BatchKind(
    "prompts", ("prompts",), "prompts with their answer fields; the loop samples num_generations completions of each",
    row_keys=(*ROW_KEYS, SAMPLER_LOGPS_KEY), sequences=None, held_out="answers", generates=True,
    extra_keys=lambda obj: ("advantages",), unit="prompts", shares_prompt=True, prompted=True,
    shares_prompt_by_default=True)

BATCH_KINDS: dict[str, BatchKind] = {k.name: k for k in (WINDOWS, ROWS, PAIRS, UNPAIRED, PROMPTS)}
KIND_OF_FORMAT: dict[str, BatchKind] = {f: k for k in BATCH_KINDS.values() for f in k.formats}
FORMATS = tuple(KIND_OF_FORMAT)  # data.format's values
PRETOKENIZED_FORMAT = "tokens"  # the WINDOWS format whose sources are token ids already


@dataclass(frozen=True)
class ObjectiveKind:
    """One objective, and everything the rest of jaxtune needs to know about it, as data: the loop, the step, the
    rollout, the evaluation and the TPU plan ask this record, never the objective's name.

    ``kinds``: the batch kinds it trains on (its ``objective.*`` keys and their defaults are its section class,
    `jaxtune.config.objectives.OBJECTIVE_SECTIONS`). ``loss_types``: its ``objective.loss_type`` values, the default
    first (empty: it has none); ``combines``: ``loss_type`` may be a list of them, summed with ``loss_weights``
    (TRL's DPO), else one only. ``beta_range``: which values ``objective.beta`` takes (``positive``;
    ``nonnegative``, where 0 turns the companion off; ``unit``, [0, 1]). ``passes_key``: the key counting optimisation
    passes per batch, if any."""

    name: str
    kinds: tuple[BatchKind, ...]
    description: str
    loss_types: tuple[str, ...] = ()
    combines: bool = False
    beta_range: Literal["positive", "nonnegative", "unit"] = "positive"
    passes_key: str | None = None
    # The second model the step holds beside the policy: none; the frozen ``reference`` it compares with (LoRA's base
    # with the adapters off, a frozen copy, or log-probs computed once), held ``always`` or only while beta > 0
    # (``companion_when``); or a ``teacher`` (another model, ``objective.teacher``) whose distributions it matches.
    companion: Literal["none", "reference", "teacher"] = "none"
    companion_when: Literal["always", "beta"] = "always"
    # Where the completions it trains on come from: ``given`` by the data; ``sampled`` by the policy inside the loop
    # (`jaxtune.rollout.rollout`); ``mixed``: sampled on a share of steps, the data's on the others (GKD's lmbda).
    completions: Literal["given", "sampled", "mixed"] = "given"
    # Objectives that sample: what each completion's reward is compared with (its objective's ``advantages``, from
    # `jaxtune.train.objectives.advantages`): "group" (GRPO's: its group's mean, over its std), "leave_one_out"
    # (RLOO's: the mean of the group's other completions), "batch" (REINFORCE++'s: the whole batch's mean, over its
    # std), or "none" (the companion, not a reward, says how good a token is: the rewards are logged only, and none
    # need be configured). A group baseline needs 2 completions of each prompt, a batch one 2 in the step
    # (`min_generations`, `min_batch`); dynamic sampling drops the groups a group baseline gives no signal.
    baseline: Literal["none", "group", "leave_one_out", "batch"] = "group"
    # What its held-out evaluation reports for a model scored against itself as the reference (every log-ratio 0),
    # whatever the model learned: said where `jaxtune eval` refuses that (a model directory without --reference)
    against_itself: str = ""
    # The model's output head: ``lm``, next-token logits; ``score``, one scalar per position (a reward model:
    # transformers' *ForSequenceClassification with num_labels 1)
    head: Literal["lm", "score"] = "lm"
    # Its loss reads each pair's ``margin`` (TRL's column; 0 where a row gives none): a "margin" array (B, 2) in the
    # batch, the pair's margin on both of its sequences
    margins: bool = False

    @property
    def group_baseline(self) -> bool:
        """Whether each sampled completion is compared with its own group's (GRPO's, RLOO's)."""
        return self.completions != "given" and self.baseline in ("group", "leave_one_out")

    @property
    def min_generations(self) -> int:
        """Completions per prompt at least: a group baseline compares each with the others of its group."""
        return 2 if self.group_baseline else 1

    @property
    def min_batch(self) -> int:
        """Completions per step at least: a batch baseline's std needs 2."""
        return 2 if self.completions != "given" and self.baseline == "batch" else 1

    @property
    def needs_rewards(self) -> bool:
        """Whether its completions are scored into advantages, so that ``objective.rewards`` must name one."""
        return self.completions != "given" and self.baseline != "none"

    @property
    def default_loss_type(self) -> str | None:
        return self.loss_types[0] if self.loss_types else None


OBJECTIVES: dict[str, ObjectiveKind] = {o.name: o for o in (
    ObjectiveKind("cross_entropy", (WINDOWS, ROWS), "next-token cross-entropy on the tokens with loss (pretraining "
                  "text, fine-tuning rows)"),
    ObjectiveKind("dpo", (PAIRS,), "direct preference optimisation against a frozen reference model",
                  loss_types=("sigmoid", "ipo", "hinge", "robust", "bco_pair", "sppo_hard", "nca_pair", "aot",
                              "aot_unpaired", "apo_zero", "apo_down", "exo_pair", "discopop", "sft", "sigmoid_norm"),
                  combines=True, companion="reference", against_itself="loss log 2 and rewards 0"),
    ObjectiveKind("simpo", (PAIRS,), "SimPO: length-normalised, reference-free, with a target margin"),
    ObjectiveKind("reward", (PAIRS,), "a reward model on preference pairs (TRL's RewardTrainer): a score head on the "
                  "model, trained so that each chosen sequence scores above its rejected one (Bradley-Terry)",
                  head="score", margins=True),
    ObjectiveKind("orpo", (PAIRS,), "ORPO: the chosen reply's NLL plus an odds-ratio term, reference-free"),
    ObjectiveKind("grpo", (PROMPTS,), "group relative policy optimisation on sampled completions scored by rewards",
                  loss_types=("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
                  beta_range="nonnegative", companion="reference", companion_when="beta", passes_key="num_iterations",
                  completions="sampled"),
    ObjectiveKind("kto", (UNPAIRED,), "KTO: unpaired desirable and undesirable completions against a frozen "
                  "reference, each reward measured from a KL baseline estimated on mismatched rows (TRL's KTOTrainer)",
                  loss_types=("kto", "apo_zero_unpaired"), companion="reference",
                  against_itself="loss 0.5 per row times its label's weight, every reward, the margin and kl 0"),
    ObjectiveKind("rloo", (PROMPTS,), "REINFORCE leave-one-out on sampled completions scored by rewards: each "
                  "completion's baseline the mean reward of its group's others, the KL to the reference in the reward, "
                  "a clipped ratio per sequence (TRL's RLOOTrainer)", beta_range="nonnegative", companion="reference",
                  companion_when="beta", passes_key="num_iterations", completions="sampled", baseline="leave_one_out"),
    ObjectiveKind("reinforce_pp", (PROMPTS,), "REINFORCE++ on sampled completions scored by rewards: each "
                  "completion's advantage its reward less the batch's mean, over the batch's std (no critic and no "
                  "group baseline), PPO's clipped token loss, an optional k3 KL to the reference in the loss",
                  beta_range="nonnegative", companion="reference", companion_when="beta", passes_key="num_iterations",
                  completions="sampled", baseline="batch"),
    ObjectiveKind("gkd", (PROMPTS,), "on-policy distillation (TRL's GKD): the student samples completions of the "
                  "prompts, a frozen teacher model scores every token, and the loss is the generalised Jensen-Shannon "
                  "divergence of the two next-token distributions (beta 0: KL(teacher || student); 1: the reverse "
                  "KL)", beta_range="unit", companion="teacher", completions="mixed", baseline="none"),
)}


def objectives_for(kind: BatchKind) -> list[str]:
    """The objectives that train on batches of ``kind``."""
    return [o.name for o in OBJECTIVES.values() if kind in o.kinds]


# The native model families (`jaxtune.models.registry.FAMILIES` holds each one's implementation, keyed by these).
FAMILY_NAMES = ("gpt2", "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma3")

# GGUF tensor types an export writes (`jaxtune.models.gguf_export`): matrices in this type, norms and biases f32.
GGUF_TYPES = ("f16", "bf16", "q8_0", "f32")
