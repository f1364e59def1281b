"""Run configuration: YAML + dotted ``key=value`` overrides, typed, validated at load, frozen.

One section per concern (model, data, tokenizer, optim, objective, train, eval, checkpoint, mesh, logging), each a
pydantic model that forbids unknown keys. Errors name the key (``optim.lr``) and, for unknown keys, suggest
the nearest valid one. Components receive only their own section (a model gets ``ModelConfig``, never ``Config``).
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import logging
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

log = logging.getLogger(__name__)

SHIPPED_CONFIGS = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A configuration problem; the message names the key or file and says what to do."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# LoRA target names: the native decoder's module names, and the HuggingFace/PEFT names users know them by.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
LORA_HF_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                 "down_proj": "down"}
LORA_OUR_TO_HF = {ours: hf for hf, ours in LORA_HF_NAMES.items()}


class LoraConfig(_Section):
    """Low-rank adapters (LoRA, as PEFT defines it): ``W x + (alpha / rank) B A dropout(x)`` on the target
    projections, base weights frozen. ``rank: 0`` is full fine-tuning. With LoRA, ``model.param_dtype`` is the
    frozen base's dtype (bfloat16 halves its memory); the adapters are always float32."""

    rank: int = Field(0, ge=0, description="0: no adapters (every parameter trains)")
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: list[str] = Field(list(LORA_TARGETS), description="q k v o gate up down (or q_proj ... down_proj), "
                               "or 'all'")

    @field_validator("targets", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        names = [v] if isinstance(v, str) else list(v)
        if names in (["all"], ["all-linear"]):
            return list(LORA_TARGETS)
        out = []
        for n in names:
            ours = LORA_HF_NAMES.get(n, n)
            if not isinstance(ours, str) or not ours.replace("_", "").isalnum():
                raise ValueError(f"LoRA target {n!r} is not a module name; choose from {list(LORA_TARGETS)} "
                                 f"(or {list(LORA_HF_NAMES)}, or 'all')")
            if ours not in out:  # other names are modules of a torchax model (qkv_proj...): checked when built
                out.append(ours)
        if not out:
            raise ValueError("needs at least one target module")
        return out


# The model keys that are a checkpoint's shapes: with model.from_hf, its config.json decides them (setting one is an
# error, `jaxtune.models.resolve`).
STRUCTURAL = ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model", "d_ff", "vocab_size")
# What a recipe's model section yields when model.from_hf is given on the command line: the checkpoint decides the
# family, the shapes and the context length (`load_config`).
CHECKPOINT_DECIDES = ("family", "preset", *STRUCTURAL, "max_seq_len", "hf_config")


class _ModelSection(_Section):
    """Keys every backend reads. ``backend`` picks the section's class (`ModelConfig`): each backend accepts only
    its own keys, so a key of another backend is an error that says which backend it belongs to."""

    from_hf: str | None = Field(None, description="start from a HuggingFace checkpoint directory (config.json + "
                                "safetensors) or hub name; it decides the family and shapes")
    max_seq_len: int | None = Field(None, ge=1)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    lora: LoraConfig = LoraConfig()


class NativeModelConfig(_ModelSection):
    """``backend: native``: jaxtune's Flax model of the family. ``preset`` picks a family preset; any other key set
    here overrides it."""

    backend: Literal["native"] = "native"
    family: Literal["gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma3"] | None = Field(
        None, description="default gpt2; with from_hf, the checkpoint's")
    preset: str = "tiny"
    n_layer: int | None = Field(None, ge=1)
    n_head: int | None = Field(None, ge=1)
    n_kv_head: int | None = Field(None, ge=1, description="key/value heads (grouped-query attention)")
    head_dim: int | None = Field(None, ge=1)
    d_model: int | None = Field(None, ge=1)
    d_ff: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=2, description="default: the tokenizer's vocabulary size")
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    scan_layers: bool = False
    attention: Literal["auto", "xla", "cudnn"] = "auto"


class TorchaxModelConfig(_ModelSection):
    """``backend: torchax``: the HuggingFace PyTorch model itself, run through JAX. The transformers config decides
    the architecture."""

    HINT: ClassVar[str] = "the transformers config decides the architecture; edit its config.json instead"

    backend: Literal["torchax"] = "torchax"
    hf_config: str | None = Field(None, description="a transformers config.json (or its directory) to build a "
                                  "randomly initialised model instead of from_hf")
    trust_remote_code: bool = Field(False, description="allow model code shipped with the checkpoint")

    @model_validator(mode="after")
    def _one_source(self) -> TorchaxModelConfig:
        if bool(self.from_hf) == bool(self.hf_config):
            raise ValueError("model.backend=torchax needs exactly one of model.from_hf (a checkpoint) or "
                             "model.hf_config (a config.json, random init)")
        return self


# The model section's class per backend (a backend is `jaxtune.backends.BACKENDS`' entry plus its section here).
MODEL_SECTIONS: dict[str, type[_ModelSection]] = {"native": NativeModelConfig, "torchax": TorchaxModelConfig}


def _backend_of(v: Any) -> str:
    return (v.get("backend") if isinstance(v, dict) else getattr(v, "backend", None)) or "native"


ModelConfig = Annotated[
    Annotated[NativeModelConfig, Tag("native")] | Annotated[TorchaxModelConfig, Tag("torchax")],
    Discriminator(_backend_of, custom_error_type="backend",
                  custom_error_message=f"model.backend must be one of {list(MODEL_SECTIONS)}"),
]


class DataConfig(_Section):
    """Training data. ``sources`` entries: ``python-stdlib`` (the running interpreter's own standard
    library source, present on every machine), a local file, glob or directory (.txt/.jsonl/.parquet), or
    ``hf:NAME`` for a HuggingFace dataset (``hf:roneneldan/TinyStories``).

    ``format: text`` is pretraining text cut into windows (``tokens``: pretraining token ids already made, nanoGPT or
    llm.c ``.bin``, ``.npy``, or ``input_ids`` rows; `jaxtune.data.pretokenized`); the other formats are supervised
    fine-tuning rows (see `jaxtune.data.formats`): ``messages`` (OpenAI chat), ``sharegpt`` (``conversations`` of ``from``/``value``),
    ``alpaca`` (``instruction``/``input``/``output``) and ``prompt_completion``, rendered by the tokenizer's chat
    template (or ``chat_template``), loss on the tokens ``loss_on`` names, packed into ``seq_len`` rows; and
    ``preference``: pairs of completions, ``prompt``/``chosen``/``rejected`` in TRL's forms (text, or messages with an
    explicit or implicit prompt; `jaxtune.data.preference`), one pair per item (never packed), loss on each
    completion; ``prompts``: prompts alone (``prompt`` text or messages, or ``messages`` ending with a user turn) with
    their answer fields, for objectives that generate their completions (``grpo``; `jaxtune.data.prompts`)."""

    sources: list[str] = ["python-stdlib"]
    format: Literal["text", "tokens", "messages", "sharegpt", "alpaca", "prompt_completion", "preference",
                    "prompts"] = "text"
    text_field: str = "text"
    fields: dict[str, str] = Field({}, description="SFT field names when they differ from the format's: messages, "
                                   "role, content, system, instruction, input, output, prompt, completion, chosen, "
                                   "rejected")
    roles: dict[str, str] = Field({}, description="sharegpt: speaker names -> system/user/assistant "
                                  "(default human->user, gpt->assistant)")
    chat_template: str | None = Field(None, description="chatml, gemma, a .jinja file, or template text; default the "
                                      "tokenizer's own")
    loss_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    bad_rows: Literal["raise", "drop"] = Field("raise", description="raise: stop at the first bad row (file:line); "
                                               "drop: skip bad rows, counted per reason")
    overlong: Literal["truncate", "drop", "raise"] = Field("truncate", description="rows longer than seq_len + 1 "
                                                           "tokens")
    packing: bool = Field(True, description="pack several rows per sequence (segment ids keep them apart); "
                          "false: one row per sequence, padded")
    val_sources: list[str] = Field([], description="held-out SFT data; default: data.val_fraction of the rows")
    hf_split: str = "train"
    hf_config: str | None = None
    max_bytes: int | None = Field(None, ge=1, description="stop reading sources after this many bytes of text")
    seq_len: int = Field(256, ge=2)
    val_fraction: float = Field(0.05, ge=0.0, le=0.5)
    cache_dir: str = "~/.cache/jaxtune"
    num_workers: int = Field(0, ge=0, description="grain worker processes; 0 reads in the main process")
    num_proc: int | None = Field(None, ge=1, description="processes tokenizing the corpus; default all cores (the "
                                 "tokens are identical for any count)")
    token_vocab_size: int | None = Field(None, ge=1, description="format tokens: the vocabulary the token files "
                                         "assume; checked against the tokenizer's")
    token_eos_id: int | None = Field(None, ge=0, description="format tokens: the eos id the token files separate "
                                     "documents with; checked against the tokenizer's")

    @field_validator("sources", "val_sources", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("roles")
    @classmethod
    def _known_roles(cls, v: dict[str, str]) -> dict[str, str]:
        wrong = {k: r for k, r in v.items() if r not in ("system", "user", "assistant")}
        if wrong:
            raise ValueError(f"roles map speaker names to system, user or assistant; not {wrong}")
        return v

    @field_validator("sources")
    @classmethod
    def _not_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one source, e.g. python-stdlib or data/*.txt")
        return v


class TokenizerConfig(_Section):
    """``bpe`` trains a byte-level BPE on the corpus (cached); ``hf`` loads a tokenizer directory
    (tokenizer.json) or hub name; ``tiktoken`` uses a tiktoken encoding such as ``gpt2``."""

    kind: Literal["bpe", "hf", "tiktoken"] = "bpe"
    path: str | None = Field(None, description="hf: tokenizer directory or hub name; tiktoken: encoding name")
    vocab_size: int = Field(8192, ge=260)
    train_bytes: int = Field(20_000_000, ge=1, description="bpe: text bytes used to train the tokenizer")
    special_tokens: list[str] = Field([], description="bpe: extra special tokens, e.g. a chat template's "
                                      "<|im_start|> and <|im_end|>")

    # The key errors about ``path`` name: model.from_hf when this is the checkpoint's own tokenizer (`Config`).
    _path_key: str = PrivateAttr("tokenizer.path")

    @model_validator(mode="after")
    def _path_when_needed(self) -> TokenizerConfig:
        if self.kind != "bpe" and not self.path:
            raise ValueError(f"tokenizer.kind={self.kind} needs tokenizer.path")
        return self

    @classmethod
    def of_checkpoint(cls, from_hf: str) -> TokenizerConfig:
        """A HuggingFace checkpoint's own tokenizer (``model.from_hf``); errors about it name model.from_hf."""
        tok = cls(kind="hf", path=from_hf)
        tok._path_key = "model.from_hf"
        return tok

    @property
    def path_key(self) -> str:
        """``tokenizer.path``, or ``model.from_hf`` for a checkpoint's own tokenizer: the key the user set."""
        return self._path_key


class OptimConfig(_Section):
    name: Literal["adamw", "adafactor", "sgd"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd only")
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    decay_steps: int | None = Field(None, ge=1, description="in optimizer updates; default: train.steps (times "
                                    "objective.num_iterations for grpo)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class TrainConfig(_Section):
    seed: int = 0
    steps: int = Field(1000, ge=1)
    batch_size: int = Field(8, ge=1, description="global batch, in sequences")
    micro_batches: int = Field(1, ge=1, description="gradient accumulation: micro-batches per step")
    on_nan: Literal["abort", "skip"] = "abort"
    max_nan_skips: int = Field(5, ge=1, description="skip: abort after this many non-finite steps in a row")
    compile_cache_dir: str | None = Field("~/.cache/jaxtune/xla", description="JAX's persistent compilation cache "
                                          "(null: off); entries are keyed by program, flags, device and versions")
    loss_chunk: int = Field(0, ge=0, description="sequence positions per cross-entropy chunk (large vocabularies); "
                            "0: auto, chunking only when the batch's float32 logits would exceed 1 GiB")
    profile_steps: tuple[int, int] | None = Field(None, description="[START, END]: a jax.profiler trace of steps "
                                                  "START..END (1-based, inclusive) under run_dir/profile/")

    @model_validator(mode="after")
    def _divides(self) -> TrainConfig:
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"train.batch_size={self.batch_size} is not divisible by train.micro_batches={self.micro_batches}"
            )
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not 1 <= first <= last <= self.steps:
                raise ValueError(f"train.profile_steps={list(self.profile_steps)}: want [START, END] with 1 <= START "
                                 f"<= END <= train.steps ({self.steps}), e.g. [10, 15] (after the first step's "
                                 "compile)")
        return self


# Objectives trained on preference pairs (``data.format: preference``), and those that compare with a reference model.
PREFERENCE_OBJECTIVES = ("dpo", "simpo", "orpo")
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0, "orpo": 0.1, "grpo": 0.0}
DEFAULT_LOSS_TYPE = {"dpo": "sigmoid", "grpo": "dapo"}
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
# The reward functions built in (`jaxtune.train.rewards`); any other name is a user function, ``module:function``.
BUILTIN_REWARDS = ("exact_number", "regex", "format", "length")


class RewardConfig(_Section):
    """One reward function of ``grpo`` (`jaxtune.train.rewards`), weighted into the total reward.

    Built in: ``exact_number`` (1 when the completion's last number equals the row's ``field``, numerically, else 0),
    ``regex`` (1 when ``pattern``'s first group, searched in the completion, equals the row's ``field``, stripped),
    ``format`` (1 when ``pattern`` matches the whole completion, stripped), ``length`` (DAPO's soft overlong penalty:
    0 up to ``max_tokens - buffer`` completion tokens, then down linearly to -1 at ``max_tokens`` and beyond). Any
    other ``name`` is a user function ``module:function`` called as ``f(prompts, completions, rows)`` (lists of the
    prompt texts, completion texts and the rows' fields) that returns one float per completion."""

    name: str
    weight: float = 1.0
    field: str = Field("answer", description="exact_number, regex: the row field holding the right answer")
    pattern: str | None = Field(None, description="regex: the pattern whose first group is the answer; format: the "
                                "pattern the whole completion must match")
    max_tokens: int | None = Field(None, ge=1, description="length: the longest completion (default "
                                   "objective.max_completion_length)")
    buffer: int | None = Field(None, ge=1, description="length: the tokens before max_tokens over which the penalty "
                               "grows (default max_tokens / 4)")

    @property
    def builtin(self) -> bool:
        return ":" not in self.name

    @model_validator(mode="after")
    def _known(self) -> RewardConfig:
        if self.builtin and self.name not in BUILTIN_REWARDS:
            raise ValueError(f"reward {self.name!r} is not built in ({', '.join(BUILTIN_REWARDS)}); a function of "
                             "your own is named module:function")
        if self.name in ("regex", "format") and not self.pattern:
            raise ValueError(f"reward {self.name} needs a pattern")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"reward {self.name}: pattern {self.pattern!r} is not a valid regex: {e}") from None
        return self


class ObjectiveConfig(_Section):
    """What the training minimises (`jaxtune.train.objectives`).

    ``cross_entropy``: next-token cross-entropy on the tokens with loss (pretraining text, SFT's assistant turns).
    Preference pairs (``data.format: preference``): ``dpo`` (against a frozen reference model: LoRA's base with the
    adapters off, else a frozen copy of the initial weights, or its log-probs computed once before training with
    ``precompute_ref_logps``), and the reference-free ``simpo`` and ``orpo``. Prompts (``data.format: prompts``):
    ``grpo``, RL with verifiable rewards: ``num_generations`` completions sampled per prompt inside the loop, scored by
    ``rewards``, the clipped policy-gradient surrogate on group-normalised advantages, and with ``beta`` > 0 a KL
    penalty to the reference model. Their keys follow TRL's."""

    name: Literal["cross_entropy", "dpo", "simpo", "orpo", "grpo"] = "cross_entropy"
    beta: float | None = Field(None, ge=0, description="dpo: the KL weight (default 0.1); simpo: the reward scale "
                               "(default 2.0); orpo: the odds-ratio term's weight lambda (TRL's beta, default 0.1); "
                               "grpo: the KL penalty's weight (default 0: no reference model)")
    loss_type: Literal["sigmoid", "ipo", "hinge", "grpo", "dr_grpo", "dapo"] | None = Field(
        None, description="dpo: sigmoid (the DPO paper, default), ipo (squared, per-token log-ratios) or hinge; grpo: "
        "how the per-token losses are averaged: grpo (per sequence, then over sequences), dr_grpo (summed, over "
        "sequences x max_completion_length), dapo (over the whole batch's completion tokens, default)")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="dpo (sigmoid) and simpo: the assumed share of "
                                   "flipped labels (conservative DPO)")
    gamma: float = Field(0.5, ge=0.0, description="simpo: the target reward margin (TRL's simpo_gamma)")
    precompute_ref_logps: bool = Field(False, description="dpo: compute the reference log-probs of every pair once "
                                       "before training (stored in the run directory), so no reference model is "
                                       "held while training")
    # grpo
    num_generations: int = Field(8, ge=2, description="grpo: completions sampled per prompt (the group)")
    max_completion_length: int = Field(128, ge=1, description="grpo: new tokens per completion at most")
    temperature: float = Field(1.0, gt=0, description="grpo: sampling temperature (the log-probs are of the same "
                               "tempered distribution, as TRL's)")
    top_p: float = Field(1.0, gt=0, le=1, description="grpo: nucleus sampling")
    top_k: int | None = Field(None, ge=1, description="grpo: sample among the k likeliest tokens")
    epsilon: float = Field(0.2, gt=0, lt=1, description="grpo: the ratio's lower clip, 1 - epsilon")
    epsilon_high: float | None = Field(None, gt=0, description="grpo: the ratio's upper clip, 1 + epsilon_high "
                                       "(default epsilon)")
    scale_rewards: bool = Field(True, description="grpo: divide each group's advantages by its reward std "
                                "(false: Dr. GRPO's unscaled advantages)")
    num_iterations: int = Field(1, ge=1, description="grpo: optimisation passes over each batch of completions "
                                "(TRL's mu)")
    rewards: list[RewardConfig] = Field([], description="grpo: reward functions, summed with their weights")
    reward_errors: Literal["raise", "zero"] = Field("raise", description="grpo: a reward function that raises or "
                                                    "returns NaN stops training (raise, naming it and the row) or "
                                                    "scores that completion 0, counted (zero)")

    @model_validator(mode="before")
    @classmethod
    def _legacy_loss_type(cls, data: Any) -> Any:
        # Configs written before grpo set loss_type: sigmoid for every objective; it only ever meant dpo's.
        if isinstance(data, dict) and data.get("loss_type") == "sigmoid" and data.get("name", "cross_entropy") != "dpo":
            data = {k: v for k, v in data.items() if k != "loss_type"}
        return data

    @property
    def preference(self) -> bool:
        return self.name in PREFERENCE_OBJECTIVES

    @property
    def uses_reference(self) -> bool:
        return self.name == "dpo" or (self.name == "grpo" and self.beta_value > 0)

    @property
    def beta_value(self) -> float:
        return self.beta if self.beta is not None else DEFAULT_BETA.get(self.name, 0.0)

    @property
    def loss_type_value(self) -> str | None:
        return self.loss_type if self.loss_type is not None else DEFAULT_LOSS_TYPE.get(self.name)

    @model_validator(mode="after")
    def _keys_apply(self) -> ObjectiveConfig:
        # Keys away from their defaults (a dumped config sets every key, at its default where unused).
        given = {k for k, f in type(self).model_fields.items() if k != "name" and getattr(self, k) != f.default}
        grpo = {"beta", "loss_type", "num_generations", "max_completion_length", "temperature", "top_p", "top_k",
                "epsilon", "epsilon_high", "scale_rewards", "num_iterations", "rewards", "reward_errors"}
        applies = {"dpo": {"beta", "loss_type", "label_smoothing", "precompute_ref_logps"},
                   "simpo": {"beta", "gamma", "label_smoothing"}, "orpo": {"beta"}, "grpo": grpo}.get(self.name, set())
        extra = sorted(given - applies)
        if extra:
            raise ValueError(f"objective.{extra[0]} does not apply to objective.name={self.name}"
                             + (f"; its keys: {', '.join(sorted(applies))}" if applies else ""))
        kinds = {"dpo": ("sigmoid", "ipo", "hinge"), "grpo": GRPO_LOSS_TYPES}
        if self.loss_type is not None and self.loss_type not in kinds.get(self.name, ()):
            raise ValueError(f"objective.loss_type={self.loss_type} does not apply to objective.name={self.name}; "
                             f"choose one of {', '.join(kinds[self.name])}")
        if self.label_smoothing and self.name == "dpo" and self.loss_type_value != "sigmoid":
            raise ValueError("objective.label_smoothing applies to loss_type=sigmoid only")
        if self.beta == 0 and self.name in PREFERENCE_OBJECTIVES:
            raise ValueError(f"objective.beta must be > 0 for objective.name={self.name}")
        if self.name == "grpo" and not self.rewards:
            raise ValueError("objective.name=grpo needs at least one reward function in objective.rewards, e.g. "
                             "[{name: exact_number, field: answer}]")
        return self


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="0: only at the end")
    batches: int = Field(8, ge=1)
    prompts: list[str] = []
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    exact_match: int = Field(0, ge=0, description="fine-tuning: the first N held-out rows answered greedily (up to "
                             "max_new_tokens) and compared with their reference reply; 0: off")


class CheckpointConfig(_Section):
    every: int = Field(500, ge=1)
    keep: int = Field(3, ge=1)
    keep_every: int | None = Field(None, ge=1, description="also keep every K-th step forever")
    async_save: bool = True


class MeshConfig(_Section):
    """Device mesh axis sizes; one axis may be -1 ("the rest of the devices")."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    @model_validator(mode="after")
    def _one_rest(self) -> MeshConfig:
        sizes = [self.data, self.fsdp, self.tensor]
        if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh axes are positive sizes, with at most one -1")
        return self


class DistributedConfig(_Section):
    """Multi-host runs (`jax.distributed.initialize`); see jaxtune.train.distributed. Leave everything unset on
    TPU VMs, SLURM and Open MPI: JAX reads the cluster from the environment."""

    initialize: Literal["auto", "always", "never"] = "auto"
    coordinator_address: str | None = Field(None, description="host:port of process 0 (or JAX_COORDINATOR_ADDRESS)")
    num_processes: int | None = Field(None, ge=1)
    process_id: int | None = Field(None, ge=0)


class LoggingConfig(_Section):
    every: int = Field(10, ge=1)
    progress: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    wandb_project: str | None = None


class Config(_Section):
    name: str = "run"
    run_dir: str = "runs/${name}"
    model: ModelConfig = NativeModelConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    optim: OptimConfig = OptimConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _checkpoint_tokenizer(self) -> Config:
        """Starting from a HuggingFace checkpoint, the tokenizer is the checkpoint's unless one is configured."""
        if self.model.from_hf and "tokenizer" not in self.model_fields_set:
            return self.model_copy(update={"tokenizer": TokenizerConfig.of_checkpoint(self.model.from_hf)})
        return self

    @model_validator(mode="after")
    def _objective_matches_data(self) -> Config:
        prompts, grpo = self.data.format == "prompts", self.objective.name == "grpo"
        if grpo != prompts:
            raise ValueError("objective.name=grpo trains on prompts: set data.format=prompts (rows of prompt and answer "
                             "fields)" if grpo else "data.format=prompts needs an objective that generates its "
                             "completions: set objective.name=grpo")
        if grpo and self.objective.max_completion_length >= self.data.seq_len:
            raise ValueError(f"objective.max_completion_length={self.objective.max_completion_length} leaves no room "
                             f"for a prompt in data.seq_len={self.data.seq_len} (prompt and completion together); "
                             "raise data.seq_len or lower max_completion_length")
        pairs = self.data.format == "preference"
        if self.objective.preference and not pairs:
            raise ValueError(f"objective.name={self.objective.name} trains on preference pairs; set "
                             "data.format=preference (rows of prompt, chosen, rejected)")
        if pairs and not self.objective.preference:
            raise ValueError(f"data.format=preference needs a preference objective; set objective.name to one of "
                             f"{', '.join(PREFERENCE_OBJECTIVES)}")
        return self

    @property
    def max_prompt_tokens(self) -> int | None:
        """GRPO: the longest prompt in tokens, what ``data.seq_len`` leaves after ``max_completion_length``."""
        return self.data.seq_len - self.objective.max_completion_length if self.objective.name == "grpo" else None

    @property
    def optimizer_updates(self) -> int:
        """Optimizer updates in the whole run (what ``optim``'s schedule counts): ``train.steps``, times GRPO's
        ``num_iterations`` passes per step."""
        return self.train.steps * (self.objective.num_iterations if self.objective.name == "grpo" else 1)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir.replace("${name}", self.name)).expanduser()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# What a checkpoint *is*: resuming with one of these keys changed is refused (`identity_diff`). Each changes the math of
# a step (the model, its dtypes and adapters, the tokens, the optimizer, the objective, the seed and the batch, whose
# micro-batch index feeds the dropout keys), which data is trained on or in which order, or the layout of what the
# checkpoint holds (model.scan_layers stacks the layers' params; data.num_workers shapes the saved data position).
# A section's name stands for every key in it.
IDENTITY_KEYS = (
    "model.backend", "model.from_hf", "model.hf_config", "model.family", "model.preset",
    *(f"model.{k}" for k in STRUCTURAL), "model.max_seq_len", "model.dropout", "model.param_dtype",
    "model.compute_dtype", "model.scan_layers", "model.lora",
    "data.sources", "data.format", "data.text_field", "data.fields", "data.roles", "data.chat_template", "data.loss_on",
    "data.overlong", "data.packing", "data.val_sources", "data.val_fraction", "data.hf_split", "data.hf_config",
    "data.max_bytes", "data.seq_len", "data.num_workers",
    "tokenizer", "optim", "objective",
    "train.seed", "train.batch_size", "train.micro_batches",
)
# Free to change on resume: names and places (the data cache included), how a step is computed with the same math
# (remat, attention kernel, loss chunks), how long (train.steps: a longer run continues; with optim.decay_steps unset
# the schedule follows the new length), what happens on a bad row or a NaN (data.bad_rows: a run that got this far
# had none or dropped them; raise stops before training), how many processes tokenize (data.num_proc: the tokens are
# identical for any count) and what token files are checked against (data.token_*: they change no id), and how often
# to evaluate, save and log.
RESUMABLE_KEYS = (
    "name", "run_dir", "model.remat", "model.attention", "model.trust_remote_code", "data.cache_dir", "data.bad_rows",
    "data.num_proc", "data.token_vocab_size", "data.token_eos_id",
    "train.steps", "train.on_nan", "train.max_nan_skips", "train.compile_cache_dir", "train.loss_chunk",
    "train.profile_steps",
    "eval", "checkpoint", "mesh", "distributed", "logging",
)


def is_identity_key(key: str) -> bool:
    """Whether the dotted ``key`` (``model.lora.rank``) is one of `IDENTITY_KEYS` or a key inside one."""
    return any(key == k or key.startswith(k + ".") for k in IDENTITY_KEYS)


def identity_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys of `IDENTITY_KEYS` whose values differ between a checkpoint's config and the current one. A key
    the checkpoint's config lacks (added to jaxtune since it was written) counts as that key's default; a key the
    current config lacks (removed since) is not compared."""
    a, b, defaults = _flatten(saved), _flatten(current), _flatten(Config().to_dict())
    for flat in (a, b):  # objective.loss_type: the objective's default stands for itself, and old dumps' sigmoid
        name = flat.get("objective.name", "cross_entropy")
        if flat.get("objective.loss_type") == "sigmoid" and name != "dpo":
            flat["objective.loss_type"] = None
        if flat.get("objective.loss_type") is None:
            flat["objective.loss_type"] = DEFAULT_LOSS_TYPE.get(name)
    old = {k: a.get(k, defaults.get(k)) for k in b}
    return [f"{k}: checkpoint has {old[k]!r}, config has {b[k]!r}" for k in sorted(b)
            if is_identity_key(k) and old[k] != b[k]]


# Config fields holding free-form mappings: compared whole, not as sections.
_MAPPINGS = ("fields", "roles")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in _MAPPINGS:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolve_config_path(path: str | Path) -> Path:
    """A YAML path, or the bare name of a shipped config (``quickstart`` -> configs/quickstart.yaml)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    shipped = SHIPPED_CONFIGS / f"{Path(str(path)).stem}.yaml"
    if p.suffix in ("", ".yaml", ".yml") and not p.parent.name and shipped.is_file():
        return shipped
    names = sorted(x.stem for x in SHIPPED_CONFIGS.glob("*.yaml"))
    raise ConfigError(f"config file not found: {path}. Pass a YAML path or a shipped config: {', '.join(names)}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or start from defaults), apply ``a.b=value`` overrides, validate and freeze."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = resolve_config_path(path)
        source = str(p)
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark else str(p)
            raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, data:, ...)")
    given = copy.deepcopy(raw)
    for item in overrides:
        _apply_override(given, item)
    if _from_hf(given) and _from_hf(given) != _from_hf(raw):
        # A checkpoint named on the command line decides the family, the shapes and the tokenizer: the file's values
        # for those yield to it. Overrides of them still apply (and a shape override is still an error).
        given = _yield_to_checkpoint(raw)
        for item in overrides:
            _apply_override(given, item)
    return config_from_dict(given, source=source)


def _from_hf(raw: dict[str, Any]) -> Any:
    model = raw.get("model")
    return model.get("from_hf") if isinstance(model, dict) else None


def _yield_to_checkpoint(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without what a HuggingFace checkpoint decides: its model keys in `CHECKPOINT_DECIDES` and its tokenizer
    section."""
    out = {k: v for k, v in copy.deepcopy(raw).items() if k != "tokenizer"}
    if isinstance(out.get("model"), dict):
        out["model"] = {k: v for k, v in out["model"].items() if k not in CHECKPOINT_DECIDES}
    return out


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError:
        node[parts[-1]] = value


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc, section = _section_at([str(x) for x in e["loc"]])
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            lines.append(f"  {_unknown_key(loc, section)}")
        elif e["type"] == "backend":
            lines.append(f"  {key}.backend: {e['msg']} (got {_backend_of(e.get('input'))!r})")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _section_at(loc: list[str]) -> tuple[list[str], type[BaseModel] | None]:
    """The key path as the user wrote it (without pydantic's backend tag after ``model``), and the section class
    holding its last key (None past the sections)."""
    model: type[BaseModel] | None = Config
    if loc[:1] == ["model"] and len(loc) > 1 and loc[1] in MODEL_SECTIONS:
        model, loc = MODEL_SECTIONS[loc[1]], ["model", *loc[2:]]
        parents = loc[1:-1]
    else:
        parents = loc[:-1]
    for part in parents:
        ann = model.model_fields[part].annotation if model is not None and part in model.model_fields else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return loc, model


def _unknown_key(loc: list[str], section: type[BaseModel] | None) -> str:
    valid = list(section.model_fields) if section is not None else []
    name = loc[-1]
    owners = [b for b, cls in MODEL_SECTIONS.items() if name in cls.model_fields] if loc[:1] == ["model"] else []
    if owners and section is not None:
        tag = section.model_fields["backend"].default
        hint = getattr(section, "HINT", "")
        return (f"model.{name} does not apply to model.backend={tag}{f' ({hint})' if hint else ''}; "
                f"model.{name} is for model.backend={owners[0]}")
    near = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    key = ".".join(loc)
    return f"{key}: unknown key; did you mean {'.'.join(loc[:-1] + near[:1])}?" if near else \
        f"{key}: unknown key; valid keys: {', '.join(valid)}"


# --- HuggingFace hub names (model.from_hf, tokenizer.path) ---

HUB_TIMEOUT = 5.0  # seconds the hub gets to answer its one request before a name is looked up in the local cache only
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


class HubError(ConfigError):
    """A hub name that cannot be had here; ``reason`` says why in a few words, the message also what to do."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def local_or_hub(name: str, key: str, files: list[str]) -> Path:
    """The directory ``name`` (the value of config ``key``) stands for: a local path as is (existing or not), or for a
    hub name (``org/model``) its snapshot in the HuggingFace cache, with the files matching ``files`` downloaded once.

    The hub is asked once, with a `HUB_TIMEOUT` (huggingface_hub's own calls wait without limit, and transformers'
    retry with backoff); when it cannot be reached, or ``HF_HUB_OFFLINE`` is set, the cached snapshot is used, and
    without one the error names ``key`` and the two ways on: a local directory, or ``HF_HUB_OFFLINE`` with a filled
    cache."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or not _HUB_NAME.fullmatch(name):
        return path  # the caller says what it lacks
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        raise ConfigError(f"{key}={name}: not a local directory; downloading it from the HuggingFace hub needs "
                          "huggingface_hub: pip install 'jaxtune[hf]'") from None
    offline = constants.HF_HUB_OFFLINE
    unreachable = "HF_HUB_OFFLINE is set" if offline else _unreachable(name, key)
    try:
        found = Path(snapshot_download(name, allow_patterns=files, local_files_only=bool(unreachable)))
    except errors.LocalEntryNotFoundError as e:
        if not unreachable:  # the hub answered the first request, then stopped
            unreachable = f"the HuggingFace hub download stopped ({_one_line(e)})"
        partly = isinstance(e, errors.IncompleteSnapshotError)
        fill = f"`hf download {name}` where there is network"
        raise HubError(f"{key}={name}: not a local directory, {'and only partly in' if partly else 'nor in'} the "
                       f"HuggingFace cache ({constants.HF_HUB_CACHE}), and {unreachable}; pass a local directory "
                       f"({key}=DIR: a save_pretrained or `hf download {name} --local-dir DIR` copy) or "
                       + (f"fill the cache ({fill})" if offline else f"set HF_HUB_OFFLINE=1 with {name} in the cache "
                          f"({fill})"),
                       f"{unreachable}, and {name} is {'only partly' if partly else 'not'} in the HuggingFace cache"
                       ) from None
    except Exception as e:  # noqa: BLE001 (gated, missing, a failed download: reported with the hub's own words)
        reason = _one_line(e)
        raise HubError(f"{key}={name}: not a local directory, and the HuggingFace hub download failed: {reason}",
                       reason) from None
    if unreachable and not offline:
        _note_cached(name, unreachable, str(found))
    return found


@functools.cache
def _unreachable(name: str, key: str) -> str:
    """Why the hub cannot be reached ('' when it answers), found with one request; a refusal of ``name`` (missing,
    gated, private) is a `HubError`. Asked once per name and process."""
    from huggingface_hub import HfApi, constants, errors

    try:
        HfApi().repo_info(name, timeout=HUB_TIMEOUT)
    except errors.HfHubHTTPError as e:
        reason = _one_line(e)
        raise HubError(f"{key}={name}: not a local directory, and the HuggingFace hub refuses it: {reason}",
                       reason) from None
    except Exception as e:  # noqa: BLE001 (no connection, DNS, a timeout, a proxy: whatever stops the request)
        return f"the HuggingFace hub at {constants.ENDPOINT} cannot be reached ({_one_line(e)})"
    return ""


@functools.cache
def _note_cached(name: str, unreachable: str, where: str) -> None:
    log.warning("%s; using the cached copy of %s (%s)", unreachable, name, where)


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def dump_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_json(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)
