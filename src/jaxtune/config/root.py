"""The whole run's config (`Config`): every section, and the checks that span sections (the objective against the
data's batch kind, a checkpoint's own tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import model_validator

from jaxtune.config.base import Section
from jaxtune.config.data import DataConfig, TokenizerConfig
from jaxtune.config.kinds import OBJECTIVES, objectives_for
from jaxtune.config.model import ModelConfig, NativeModelConfig
from jaxtune.config.objectives import OBJECTIVE_SECTIONS, ClippedPolicy, CrossEntropyConfig, ObjectiveConfig
from jaxtune.config.run import (
    CheckpointConfig,
    DistributedConfig,
    EvalConfig,
    LoggingConfig,
    MeshConfig,
    OptimConfig,
    TrainConfig,
)


class Config(Section):
    name: str = "run"
    run_dir: str = "runs/${name}"
    model: ModelConfig = NativeModelConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    optim: OptimConfig = OptimConfig()
    objective: ObjectiveConfig = CrossEntropyConfig()
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
    def _prompt_sharing(self) -> Config:
        """Prompt sharing needs a model that takes ``branch_ids`` (the native ones): off by default with torchax."""
        if self.model.backend == "native" or not self.data.shares_prompts:
            return self
        if self.data.share_prompts:
            raise ValueError(f"data.share_prompts=true needs a native model (its attention takes the branch ids); "
                             f"model.backend={self.model.backend} runs HuggingFace's, so set data.share_prompts=false")
        return self.model_copy(update={"data": self.data.model_copy(update={"share_prompts": False})})

    @model_validator(mode="after")
    def _scores_only(self) -> Config:
        """A reward model generates no text, so no evaluation that generates."""
        if self.objective.spec.head != "score":
            return self
        generating = [k for k, v in (("eval.exact_match", self.eval.exact_match), ("eval.prompts", self.eval.prompts))
                      if v]
        if generating:
            raise ValueError(f"{generating[0]} generates text, and objective.name={self.objective.name} trains a score "
                             "head that generates none: set eval.exact_match=0 and eval.prompts=[] (held-out reward "
                             "accuracy is evaluated)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _grpo_batch_is_named(cls, data: Any) -> Any:
        """A GRPO step's batch is counted in prompts (``objective.prompts_per_step``), never as ``train.batch_size``
        alone: TRL's batch size counts completions, so that number would be read two ways."""
        if not isinstance(data, dict):
            return data
        obj, train = data.get("objective") or {}, data.get("train") or {}
        spec = OBJECTIVES.get(obj.get("name")) if isinstance(obj, dict) else None
        if (spec is not None and any(k.generates for k in spec.kinds) and isinstance(train, dict)
                and train.get("batch_size") is not None and obj.get("prompts_per_step") is None):
            default = OBJECTIVE_SECTIONS[spec.name].model_fields["num_generations"].default
            n, g = train["batch_size"], obj.get("num_generations", default)
            raise ValueError(f"train.batch_size={n} is ambiguous for objective.name={obj['name']} (TRL's batch size "
                             f"counts completions; here each prompt is sampled num_generations times): set "
                             f"objective.prompts_per_step={n} instead ({n} prompts x {g} completions a step), and "
                             "leave train.batch_size unset (train.batch_size=null)")
        return data

    @model_validator(mode="after")
    def _grpo_prompts_per_step(self) -> Config:
        """``objective.prompts_per_step`` is GRPO's ``train.batch_size``: either sets the other, both are recorded."""
        obj, train = self.objective, self.train
        if not obj.generates:
            return self
        prompts = obj.prompts_per_step or train.batch_size
        if obj.spec.min_batch > prompts * obj.num_generations:
            raise ValueError(f"objective.prompts_per_step x num_generations = {prompts} x {obj.num_generations}: "
                             f"{obj.name} compares each reward with the batch's mean and std, so a step needs "
                             f"{obj.spec.min_batch} completions or more")
        if obj.prompts_per_step is None:
            return self.model_copy(update={"objective": obj.model_copy(update={"prompts_per_step": train.batch_size})})
        if "batch_size" in train.model_fields_set and train.batch_size != obj.prompts_per_step:
            raise ValueError(f"objective.prompts_per_step={obj.prompts_per_step} and train.batch_size="
                             f"{train.batch_size} disagree: for {obj.name} they are one number; set prompts_per_step "
                             "only")
        return self.model_copy(update={"train": train.model_copy(update={"batch_size": obj.prompts_per_step})})

    @model_validator(mode="after")
    def _sampler_devices(self) -> Config:
        if self.mesh.rollout and not getattr(self.objective, "max_staleness", 0):
            raise ValueError(f"mesh.rollout={self.mesh.rollout} gives the sampler devices of its own, to sample the "
                             "next rollouts beside the learner's step: that needs objective.max_staleness >= 1 "
                             "(grpo, rloo); drop mesh.rollout otherwise")
        return self

    @model_validator(mode="after")
    def _old_logps(self) -> Config:
        """A clipped policy's old log-probs come from the sampler where they are the trainer's to float rounding
        (float32 compute), else from a trainer forward; the resolved choice is what config.yaml records."""
        obj = self.objective
        if not isinstance(obj, ClippedPolicy) or obj.old_logps is not None:
            return self
        source = obj.default_old_logps(self.model.compute_dtype)
        return self.model_copy(update={"objective": obj.model_copy(update={"old_logps": source})})

    @model_validator(mode="after")
    def _objective_matches_data(self) -> Config:
        """The objective trains on the batch kind ``data.format`` makes (`jaxtune.config.kinds`)."""
        kind, obj = self.data.kind, self.objective
        if kind not in obj.kinds:
            formats = ", ".join(f for k in obj.kinds for f in k.formats)
            takers = objectives_for(kind)
            raise ValueError(
                f"objective.name={obj.name} trains on {' or '.join(k.name for k in obj.kinds)} "
                f"(data.format {formats}), but data.format={self.data.format} makes {kind.name} ({kind.description}); "
                f"set data.format to one of {formats}, or objective.name to "
                + (f"one of {', '.join(takers)}" if len(takers) > 1 else takers[0]))
        if obj.spec.companion == "teacher" and not obj.teacher:
            raise ValueError(f"objective.name={obj.name} needs objective.teacher: the teacher model's Hugging Face "
                             "directory (e.g. a `jaxtune export` of a fine-tuned run) or .gguf file")
        if obj.generates and obj.max_completion_length >= self.data.seq_len:
            raise ValueError(f"objective.max_completion_length={obj.max_completion_length} leaves no room "
                             f"for a prompt in data.seq_len={self.data.seq_len} (prompt and completion together); "
                             "raise data.seq_len or lower max_completion_length")
        return self

    @model_validator(mode="after")
    def _synced_reference_is_a_copy(self) -> Config:
        """TR-DPO mixes the policy into the reference: a frozen copy (full fine-tuning), never LoRA's base."""
        if self.objective.syncs_reference and self.model.lora.rank:
            raise ValueError(f"objective.sync_ref_model=true mixes the policy into a reference copy of its own, and "
                             f"with model.lora.rank={self.model.lora.rank} the reference is the base with the "
                             "adapters off (no copy); set sync_ref_model=false, or model.lora.rank=0 (full "
                             "fine-tuning)")
        return self

    @property
    def max_prompt_tokens(self) -> int | None:
        """Objectives that generate (GRPO): the longest prompt in tokens, what ``data.seq_len`` leaves after
        ``max_completion_length`` (at most ``data.max_prompt_length``)."""
        if not self.objective.generates:
            return None
        room = self.data.seq_len - self.objective.max_completion_length
        return min(room, self.data.max_prompt_length or room)

    @property
    def optimizer_updates(self) -> int:
        """Optimizer updates in the whole run (what ``optim``'s schedule counts): ``train.steps``, times the
        objective's passes per step (GRPO's ``num_iterations``)."""
        return self.train.steps * self.objective.passes

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir.replace("${name}", self.name)).expanduser()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
