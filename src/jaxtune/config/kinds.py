"""Every kind jaxtune knows, each declared once: batch kinds (what rows a data format makes, what the train step
takes, what an evaluation reports), objectives (the batch kinds they train on, their keys, loss types and defaults)
with the ``objective`` section whose keys they own, the native model families and the GGUF export types. The config's
``Literal`` types are made from these records, and the pipeline (`jaxtune.data.pipeline`), the TPU plan
(`jaxtune.aot`), evaluation and the step's metrics ask a record instead of comparing names. Nothing here imports JAX:
the CLI reads it before JAX starts.

Adding a kind is one record here (an objective's keys too) plus its implementation in the room that owns it
(`docs/architecture.md`, "Where to touch").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, model_validator

from jaxtune.config.base import Section
from jaxtune.config.rewards import RewardConfig

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
    extra_keys=lambda obj: ("ref_logps",) if obj.uses_reference and obj.precompute_ref_logps else ())
UNPAIRED = BatchKind(
    "unpaired", ("unpaired",), "unpaired preference rows: a prompt, one completion and whether it is desirable; "
    "each item the row and its KL row (its prompt with another row's completion), never packed",
    sequences=2, item_axis=True, held_out="rewards", unit="rows", prompted=True,
    extra_keys=lambda obj: ("labels",) + (("ref_logps",) if obj.uses_reference and obj.precompute_ref_logps else ()),
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

    ``kinds``: the batch kinds it trains on. ``keys``: the ``objective.*`` keys that apply to it (besides ``name``).
    ``loss_types``: its ``objective.loss_type`` values, the default first (empty: it has none); ``combines``:
    ``loss_type`` may be a list of them, summed with ``loss_weights`` (TRL's DPO), else one only. ``default_beta``:
    ``objective.beta`` when unset; ``beta_range``: which values it takes (``positive``; ``nonnegative``, where 0 turns
    the companion off; ``unit``, [0, 1]). ``passes_key``: the key counting optimisation passes per batch, if any."""

    name: str
    kinds: tuple[BatchKind, ...]
    description: str
    keys: frozenset[str] = frozenset()
    loss_types: tuple[str, ...] = ()
    combines: bool = False
    default_beta: float | None = None
    beta_range: Literal["positive", "nonnegative", "unit"] = "positive"
    passes_key: str | None = None
    # The second model the step holds beside the policy: none; the frozen ``reference`` it compares with (LoRA's base
    # with the adapters off, a frozen copy, or log-probs computed once), held ``always`` or only while beta > 0
    # (``companion_when``); or a ``teacher`` (another model, ``objective.teacher``) whose distributions it matches.
    companion: Literal["none", "reference", "teacher"] = "none"
    companion_when: Literal["always", "beta"] = "always"
    # Where the completions it trains on come from: ``given`` by the data; ``sampled`` by the policy inside the loop
    # (`jaxtune.train.rollout`); ``mixed``: sampled on a share of steps, the data's on the others (GKD's lmbda).
    completions: Literal["given", "sampled", "mixed"] = "given"
    # Objectives that sample: each completion's advantage from its group's rewards, computed when the completions are
    # scored (`jaxtune.train.rewards`): "group" (GRPO's: less the group's mean, over its std), "leave_one_out"
    # (RLOO's: less the mean of the group's other completions), or "none" (the companion, not a reward, says how good
    # a token is: the rewards are logged only, and none need be configured).
    baseline: Literal["none", "group", "leave_one_out"] = "group"
    min_generations: int = 1  # completions per prompt at least (a group baseline compares each with the others)
    default_generations: int = 8  # ``objective.num_generations`` when unset
    # `Objective.prepare` runs on the whole batch before every step (RLOO's advantages need the batch and the
    # reference), not only before the second of several passes
    prepares: bool = False

    @property
    def needs_rewards(self) -> bool:
        """Whether its completions are scored into advantages, so that ``objective.rewards`` must name one."""
        return self.completions != "given" and self.baseline != "none"

    @property
    def default_loss_type(self) -> str | None:
        return self.loss_types[0] if self.loss_types else None


_GRPO_KEYS = frozenset({"beta", "loss_type", "num_generations", "max_completion_length", "temperature", "top_p",
                        "top_k", "epsilon", "epsilon_high", "scale_rewards", "num_iterations", "rewards",
                        "reward_errors", "prompts_per_step", "old_logps", "importance_sampling", "importance_sampling_max",
                        "importance_sampling_min"})
IMPORTANCE_SAMPLING = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
_RLOO_KEYS = frozenset({"beta", "num_generations", "max_completion_length", "temperature", "top_p", "top_k",
                        "epsilon", "epsilon_high", "normalize_advantages", "num_iterations", "rewards",
                        "reward_errors", "prompts_per_step", "old_logps"})
_GKD_KEYS = frozenset({"teacher", "beta", "lmbda", "num_generations", "max_completion_length", "temperature",
                       "top_p", "top_k", "rewards", "reward_errors", "prompts_per_step"})
OBJECTIVES: dict[str, ObjectiveKind] = {o.name: o for o in (
    ObjectiveKind("cross_entropy", (WINDOWS, ROWS), "next-token cross-entropy on the tokens with loss (pretraining "
                  "text, fine-tuning rows)"),
    ObjectiveKind("dpo", (PAIRS,), "direct preference optimisation against a frozen reference model",
                  frozenset({"beta", "loss_type", "loss_weights", "label_smoothing", "discopop_tau",
                             "precompute_ref_logps"}),
                  loss_types=("sigmoid", "ipo", "hinge", "robust", "bco_pair", "sppo_hard", "nca_pair", "aot",
                              "aot_unpaired", "apo_zero", "apo_down", "exo_pair", "discopop", "sft", "sigmoid_norm"),
                  combines=True, default_beta=0.1, companion="reference"),
    ObjectiveKind("simpo", (PAIRS,), "SimPO: length-normalised, reference-free, with a target margin",
                  frozenset({"beta", "gamma", "label_smoothing"}), default_beta=2.0),
    ObjectiveKind("orpo", (PAIRS,), "ORPO: the chosen reply's NLL plus an odds-ratio term, reference-free",
                  frozenset({"beta"}), default_beta=0.1),
    ObjectiveKind("grpo", (PROMPTS,), "group relative policy optimisation on sampled completions scored by rewards",
                  _GRPO_KEYS, loss_types=("dapo", "grpo", "dr_grpo"), default_beta=0.0, beta_range="nonnegative",
                  companion="reference", companion_when="beta", passes_key="num_iterations", completions="sampled",
                  min_generations=2),
    ObjectiveKind("kto", (UNPAIRED,), "KTO: unpaired desirable and undesirable completions against a frozen "
                  "reference, each reward measured from a KL baseline estimated on mismatched rows (TRL's KTOTrainer)",
                  frozenset({"beta", "loss_type", "desirable_weight", "undesirable_weight", "precompute_ref_logps"}),
                  loss_types=("kto", "apo_zero_unpaired"), default_beta=0.1, companion="reference",
                  prepares=True),
    ObjectiveKind("rloo", (PROMPTS,), "REINFORCE leave-one-out on sampled completions scored by rewards: each "
                  "completion's baseline the mean reward of its group's others, the KL to the reference in the reward, "
                  "a clipped ratio per sequence (TRL's RLOOTrainer)", _RLOO_KEYS, default_beta=0.05,
                  beta_range="nonnegative", companion="reference", companion_when="beta", passes_key="num_iterations",
                  completions="sampled", baseline="leave_one_out", min_generations=2, prepares=True),
    ObjectiveKind("gkd", (PROMPTS,), "on-policy distillation (TRL's GKD): the student samples completions of the "
                  "prompts, a frozen teacher model scores every token, and the loss is the generalised Jensen-Shannon "
                  "divergence of the two next-token distributions (beta 0: KL(teacher || student); 1: the reverse "
                  "KL)", _GKD_KEYS, default_beta=0.5, beta_range="unit", companion="teacher", completions="mixed",
                  baseline="none", default_generations=1),
)}


def objectives_for(kind: BatchKind) -> list[str]:
    """The objectives that train on batches of ``kind``."""
    return [o.name for o in OBJECTIVES.values() if kind in o.kinds]


LOSS_TYPES = tuple(dict.fromkeys(t for o in OBJECTIVES.values() for t in o.loss_types))
# The loss types label smoothing applies to (the assumed share of flipped labels): dpo's sigmoid (conservative DPO;
# TRL 1.16's sigmoid has none), robust, exo_pair (which needs it > 0), aot and aot_unpaired; and simpo's loss.
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")



class ObjectiveConfig(Section):
    """What the training minimises (`jaxtune.train.objectives`).

    ``cross_entropy``: next-token cross-entropy on the tokens with loss (pretraining text, SFT's assistant turns).
    Preference pairs (``data.format: preference``): ``dpo`` (against a frozen reference model: LoRA's base with the
    adapters off, else a frozen copy of the initial weights, or its log-probs computed once before training with
    ``precompute_ref_logps``), and the reference-free ``simpo`` and ``orpo``. Prompts (``data.format: prompts``):
    ``grpo``, RL with verifiable rewards: ``num_generations`` completions sampled per prompt inside the loop, scored by
    ``rewards``, the clipped policy-gradient surrogate on group-normalised advantages, and with ``beta`` > 0 a KL
    penalty to the reference model. Their keys follow TRL's."""

    name: Literal[tuple(OBJECTIVES)] = Field("cross_entropy", description="; ".join(
        f"{o.name}: {o.description}" for o in OBJECTIVES.values()))
    beta: float | None = Field(None, ge=0, description="dpo: the KL weight (default 0.1); simpo: the reward scale "
                               "(default 2.0); orpo: the odds-ratio term's weight lambda (TRL's beta, default 0.1); "
                               "grpo: the KL penalty's weight (default 0: no reference model); rloo: the weight of the KL to the "
                               "reference subtracted from each reward (default 0.05, TRL's)")
    loss_type: Literal[LOSS_TYPES] | list[Literal[LOSS_TYPES]] | None = Field(
        None, description="dpo: TRL's loss types: sigmoid (the DPO paper, default), ipo (squared, per-token "
        "log-ratios), hinge, robust, bco_pair, sppo_hard, nca_pair, aot and aot_unpaired (sorted over the "
        "micro-batch), apo_zero, apo_down, exo_pair, discopop, sft (each pair's mean NLL of its chosen completion), "
        "sigmoid_norm (sigmoid on per-token log-ratios); or a list of them, summed with loss_weights (e.g. MPO: "
        "[sigmoid, bco_pair, sft]); grpo: how the per-token losses are averaged: grpo (per sequence, then over "
        "sequences), dr_grpo (summed, over sequences x max_completion_length), dapo (over the whole batch's "
        "completion tokens, default)")
    loss_weights: list[float] | None = Field(None, description="dpo with a list of loss types: each one's weight, "
                                             "in order (default 1 each)")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="dpo (sigmoid, robust, exo_pair, aot, "
                                   "aot_unpaired) and simpo: the assumed share of flipped labels (conservative DPO); "
                                   "exo_pair needs it > 0 (the EXO paper: 1e-3)")
    desirable_weight: float = Field(1.0, gt=0, description="kto: the loss weight of desirable rows (label true)")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: the loss weight of undesirable rows (label "
                                      "false)")
    discopop_tau: float = Field(0.05, gt=0, description="dpo discopop: the temperature of its logistic / exponential "
                                "mix (TRL's default)")
    gamma: float = Field(0.5, ge=0.0, description="simpo: the target reward margin (TRL's simpo_gamma)")
    precompute_ref_logps: bool = Field(False, description="dpo and kto: compute the reference log-probs of every "
                                       "pair (kto: every row and its KL row) once before training (stored in the run "
                                       "directory), so no reference model is held while training")
    # grpo
    prompts_per_step: int | None = Field(
        None, ge=1, description="grpo and rloo: prompts a step samples, each num_generations times: a step trains on "
        "prompts_per_step x num_generations completions (TRL's batch size counts those completions). It is the "
        "run's train.batch_size, which a grpo config does not set (default: train.batch_size's default)")
    num_generations: int = Field(8, ge=1, description="grpo and rloo: completions sampled per prompt (the group; at "
                                 "least 2); gkd: completions sampled per prompt (default 1)")
    teacher: str | None = Field(None, description="gkd: the teacher model, a Hugging Face checkpoint directory (a "
                                "`jaxtune export` of a run too) with the student's tokenizer; frozen, on the "
                                "student's mesh")
    lmbda: float = Field(1.0, ge=0.0, le=1.0, description="gkd: the share of steps that train on the student's own "
                         "samples (on-policy); the others train on each prompt row's completion field (supervised "
                         "distillation). TRL's lmbda (default 0.5 there)")
    max_completion_length: int = Field(128, ge=1, description="grpo and rloo: new tokens per completion at most")
    temperature: float = Field(1.0, gt=0, description="grpo and rloo: sampling temperature (the log-probs are of the same "
                               "tempered distribution, as TRL's)")
    top_p: float = Field(1.0, gt=0, le=1, description="grpo and rloo: nucleus sampling")
    top_k: int | None = Field(None, ge=1, description="grpo and rloo: sample among the k likeliest tokens")
    epsilon: float = Field(0.2, gt=0, lt=1, description="grpo and rloo: the ratio's lower clip, 1 - epsilon")
    epsilon_high: float | None = Field(None, gt=0, description="grpo and rloo: the ratio's upper clip, 1 + epsilon_high "
                                       "(default epsilon)")
    scale_rewards: bool = Field(True, description="grpo: divide each group's advantages by its reward std "
                                "(false: Dr. GRPO's unscaled advantages)")
    normalize_advantages: bool = Field(False, description="rloo: normalise the advantages over the whole batch "
                                       "(less their mean, over their std + 1e-4), after the KL penalty")
    num_iterations: int = Field(1, ge=1, description="grpo and rloo: optimisation passes over each batch of completions "
                                "(TRL's mu)")
    rewards: list[RewardConfig] = Field([], description="grpo and rloo: reward functions, summed with their weights")
    reward_errors: Literal["raise", "zero"] = Field("raise", description="grpo and rloo: a reward function that raises or "
                                                    "returns NaN stops training (raise, naming it and the row) or "
                                                    "scores that completion 0, counted (zero)")
    old_logps: Literal["sampler", "trainer"] | None = Field(
        None, description="grpo and rloo with num_iterations > 1: where the old policy's log-probs come from: the sampler's "
        "own, returned with each token (no extra forward pass), or a trainer forward before the first update "
        "(default: sampler when model.compute_dtype is float32, where the two agree to float rounding; trainer "
        "otherwise). Every step logs sampler_logp_diff/mean and /max, |sampler - trainer| over completion tokens")
    importance_sampling: Literal[IMPORTANCE_SAMPLING] = Field(
        "off", description="grpo: correct for the sampler's distribution differing from the trainer's (bfloat16, "
        "other programs) with the ratio r = pi_trainer / pi_sampler of each token (token_*) or each completion "
        "(sequence_*: the geometric mean over its tokens; TRL 1.16 takes the product), cut to "
        "[importance_sampling_min, importance_sampling_max] "
        "(*_truncate) or zeroed outside it (*_mask), multiplying each token's loss (TRL's "
        "vllm_importance_sampling_mode)")
    importance_sampling_max: float | None = Field(3.0, gt=0, description="grpo: the ratio's upper bound C_max")
    importance_sampling_min: float | None = Field(None, ge=0, description="grpo: the ratio's lower bound C_min "
                                                  "(default none)")

    @model_validator(mode="before")
    @classmethod
    def _legacy_loss_type(cls, data: Any) -> Any:
        # Configs written before grpo set loss_type: sigmoid for every objective; it only ever meant dpo's. Objectives
        # with loss types of their own (grpo) came later: sigmoid there is the user's, and an error.
        spec = OBJECTIVES.get(data.get("name", "cross_entropy")) if isinstance(data, dict) else None
        if spec is not None and data.get("loss_type") == "sigmoid" and not spec.loss_types:
            data = {k: v for k, v in data.items() if k != "loss_type"}
        if spec is not None and "num_generations" not in data:
            data = {**data, "num_generations": spec.default_generations}
        return data

    @property
    def spec(self) -> ObjectiveKind:
        """This objective's record (`jaxtune.config.kinds.OBJECTIVES`)."""
        return OBJECTIVES[self.name]

    @property
    def kinds(self) -> tuple[BatchKind, ...]:
        """The batch kinds it trains on."""
        return self.spec.kinds

    @property
    def generates(self) -> bool:
        """Whether it trains on completions the loop samples (GRPO)."""
        return any(k.generates for k in self.spec.kinds)

    @property
    def passes(self) -> int:
        """Optimiser updates per batch (GRPO's ``num_iterations``; 1 for the others)."""
        return getattr(self, self.spec.passes_key) if self.spec.passes_key else 1

    @property
    def uses_reference(self) -> bool:
        spec = self.spec
        return spec.companion == "reference" and (spec.companion_when == "always" or self.beta_value > 0)

    @property
    def beta_value(self) -> float:
        default = self.spec.default_beta
        return self.beta if self.beta is not None else (default if default is not None else 0.0)

    @property
    def loss_type_value(self) -> str | list[str] | None:
        return self.loss_type if self.loss_type is not None else self.spec.default_loss_type

    @property
    def weighted_loss_types(self) -> tuple[tuple[str, float], ...]:
        """(loss type, weight) of each term of the loss: one at weight 1, or a list with ``loss_weights``."""
        types = self.loss_type_value
        if types is None:
            return ()
        types = [types] if isinstance(types, str) else list(types)
        return tuple(zip(types, self.loss_weights or [1.0] * len(types)))

    @model_validator(mode="after")
    def _keys_apply(self) -> ObjectiveConfig:
        # Keys away from their defaults (a dumped config sets every key, at its default where unused).
        given = {k for k, f in type(self).model_fields.items() if k != "name" and getattr(self, k) != f.default}
        spec = self.spec
        applies = spec.keys
        extra = sorted(given - applies)
        if extra:
            raise ValueError(f"objective.{extra[0]} does not apply to objective.name={self.name}"
                             + (f"; its keys: {', '.join(sorted(applies))}" if applies else ""))
        listed = isinstance(self.loss_type, list)
        if listed and not spec.combines:
            raise ValueError(f"objective.loss_type: objective.name={self.name} takes one loss type, not a list")
        for t in (self.loss_type if listed else [self.loss_type] if self.loss_type is not None else []):
            if t not in spec.loss_types:
                raise ValueError(f"objective.loss_type={t} does not apply to objective.name={self.name}; "
                                 f"choose one of {', '.join(spec.loss_types)}")
        if listed and (not self.loss_type or len(set(self.loss_type)) < len(self.loss_type)):
            raise ValueError(f"objective.loss_type={self.loss_type}: list each loss type once (at least one); "
                             "weight them with objective.loss_weights")
        types = [t for t, _ in self.weighted_loss_types]
        if self.loss_weights is not None and len(self.loss_weights) != (len(self.loss_type) if listed else 1):
            raise ValueError(f"objective.loss_weights has {len(self.loss_weights)} weights for the loss types "
                             f"{types}: give one per loss type, in order")
        if self.label_smoothing and spec.loss_types and not set(types) & set(SMOOTHED):
            raise ValueError(f"objective.label_smoothing applies to loss_type {', '.join(SMOOTHED)}, not "
                             f"{', '.join(types)}")
        if "exo_pair" in types and not self.label_smoothing:
            raise ValueError("objective.loss_type exo_pair needs objective.label_smoothing > 0 (its target "
                             "distribution; the EXO paper uses 1e-3)")
        if spec.beta_range == "unit" and self.beta is not None and self.beta > 1:
            raise ValueError(f"objective.beta={self.beta}: {self.name}'s beta interpolates between KL(teacher || "
                             "student) (0) and KL(student || teacher) (1); choose it in [0, 1]")
        if spec.beta_range == "positive" and self.beta == 0:
            raise ValueError(f"objective.beta must be > 0 for objective.name={self.name}")
        if self.num_generations < spec.min_generations:
            raise ValueError(f"objective.num_generations={self.num_generations}: {self.name} compares each completion "
                             f"with its group's others; sample at least {spec.min_generations} per prompt")
        lo, hi = self.importance_sampling_min, self.importance_sampling_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"objective.importance_sampling_min={lo} is above importance_sampling_max={hi}")
        marked = [r.name for r in self.rewards if r.accuracy]
        if len(marked) > 1:
            raise ValueError(f"objective.rewards: {len(marked)} rewards set accuracy: true ({', '.join(marked)}); "
                             "held-out accuracy follows one success criterion, so mark one")
        if spec.needs_rewards and not self.rewards:
            raise ValueError(f"objective.name={self.name} needs at least one reward function in objective.rewards, "
                             "e.g. [{name: exact_number, field: answer}]")
        return self


# The native model families (`jaxtune.models.registry.FAMILIES` holds each one's implementation, keyed by these).
FAMILY_NAMES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma3")

# GGUF tensor types an export writes (`jaxtune.models.gguf_export`): matrices in this type, norms and biases f32.
GGUF_TYPES = ("f16", "bf16", "q8_0", "f32")
