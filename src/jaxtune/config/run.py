"""How the run runs: the ``optim``, ``train``, ``eval``, ``checkpoint``, ``mesh``, ``distributed`` and ``logging``
sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from jaxtune.config.base import Section


class OptimConfig(Section):
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
    formulation: int = Field(
        1, ge=0, le=1, description="1: this section's numbers (lr, warmup and decay steps, min_lr_ratio, betas, eps, "
        "weight decay, momentum, grad_clip) are inputs of the train program, so that a run with another lr or "
        "train.steps finds its program in train.compile_cache_dir instead of compiling it; 0: they are constants "
        "folded into the program, which rounds a few steps' learning rates one ulp otherwise. A run saved before this "
        "key existed resumes with 0, so that it continues bitwise")


class TrainConfig(Section):
    seed: int = 0
    steps: int = Field(1000, ge=1)
    batch_size: int = Field(8, ge=1, description="global batch, in sequences")
    micro_batches: int = Field(1, ge=1, description="gradient accumulation: micro-batches per step")
    on_nan: Literal["abort", "skip"] = "abort"
    max_nan_skips: int = Field(5, ge=1, description="skip: abort after this many non-finite steps in a row")
    compile_cache_dir: str | None = Field("~/.cache/jaxtune/xla", description="JAX's persistent compilation cache "
                                          "(null: off); entries are keyed by program, flags, device and versions, "
                                          "read and written under a file lock, the least recently used dropped "
                                          "past 8 GiB")
    compile_ahead: int = Field(32, ge=0, description="compile the held-out evaluation's programs and the train "
                               "step's for the length buckets of the next N batches on worker threads, alongside "
                               "each other and the step-0 evaluation (GRPO-like: the next prompts with every "
                               "completion at max_completion_length, alongside the first sampling); 0: each program "
                               "compiles at its first use")
    draw: Literal["cdf", "gumbel"] = Field("cdf", description="how the sampler draws a token from its softmax in "
                                           "RL rollouts (the same distribution either way): cdf, one uniform number "
                                           "a row, the CDF inverted in two levels (17 ms less per 32-row step at a "
                                           "49k vocabulary on CPU); gumbel, jax.random.categorical. A run saved "
                                           "before this key drew by gumbel and keeps it when resumed")
    loss_chunk: int = Field(0, ge=0, description="sequence positions per cross-entropy chunk (large vocabularies); "
                            "0: auto, chunking only when a device's share of the batch's float32 logits (rows, "
                            "positions and vocabulary split as the mesh splits them) would exceed 1 GiB")
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


class EvalConfig(Section):
    every: int = Field(0, ge=0, description="0: only at the end")
    batches: int = Field(8, ge=1)
    prompts: list[str] = Field([])
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    exact_match: int = Field(0, ge=0, description="fine-tuning: the first N held-out rows answered greedily (up to "
                             "max_new_tokens) and compared with their reference reply; 0: off")


class CheckpointConfig(Section):
    every: int = Field(500, ge=1)
    keep: int = Field(3, ge=1)
    keep_every: int | None = Field(None, ge=1, description="also keep every K-th step forever")
    async_save: bool = True


class MeshConfig(Section):
    """Device mesh axis sizes; one axis may be -1 ("the rest of the devices")."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    context: int = Field(1, description="devices that split each sequence's positions (context parallelism): "
                         "activations are sharded along the sequence and attention gathers the whole sequence's keys "
                         "and values; parameters are sharded over it too (like fsdp). For sequences whose activations "
                         "do not fit one device; the native backend only")

    rollout: int = Field(0, ge=0, description="with objective.max_staleness: devices of the sampler's own (the last "
                         "of the device list; with several processes the last mesh.rollout / processes of each), "
                         "where rollouts are sampled beside the learner's steps, the weights whole on each and copied "
                         "device to device after each update; the other mesh axes cover the rest. 0: the sampler "
                         "shares the learner's devices")

    @model_validator(mode="after")
    def _one_rest(self) -> MeshConfig:
        sizes = [self.data, self.fsdp, self.tensor, self.context]
        if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh axes are positive sizes, with at most one -1")
        return self


class DistributedConfig(Section):
    """Multi-host runs (`jax.distributed.initialize`); see jaxtune.job.distributed. Leave everything unset on
    TPU VMs, SLURM and Open MPI: JAX reads the cluster from the environment."""

    initialize: Literal["auto", "always", "never"] = "auto"
    coordinator_address: str | None = Field(None, description="host:port of process 0 (or JAX_COORDINATOR_ADDRESS)")
    num_processes: int | None = Field(None, ge=1)
    process_id: int | None = Field(None, ge=0)
    timeout: float = Field(300.0, gt=0, description="seconds a process waits for the coordinator (process 0) to "
                           "answer, and then for every process to join, before stopping with an error naming it")


class LoggingConfig(Section):
    every: int = Field(10, ge=1)
    progress: bool = Field(True, description="a progress bar on a terminal; when stderr is not one (a log file), a "
                           "plain progress line every 30 s instead of redraws")
    jsonl: bool = True
    tensorboard: bool = True
    wandb_project: str | None = None
