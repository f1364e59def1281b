"""The train state, and what a backend's model must offer the trainer (`ModelSpec`, `Forward`).

A backend (`jaxtune.backends`) builds a `ModelSpec` from the config before anything is allocated: the optimizer,
the mesh, and an abstract state whose leaves carry their shardings, so a state is created (jit with
out_shardings) or restored (Orbax) directly in place on the mesh, never as a full host copy. The train step,
evaluation, generation and the benchmarks use only what these protocols declare.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxtune import sharding
from jaxtune.models.sampling import Generation

Batch = dict[str, jax.Array]  # (B, T) arrays: inputs, targets; optionally positions, segment_ids, loss_mask


class TrainState(NamedTuple):
    step: jax.Array  # int32 (): optimizer steps taken
    params: Any  # pure dict of arrays: what trains (all weights, or a LoRA model's adapters)
    opt_state: Any
    key: jax.Array  # uint32 key data: the run's base key; step keys are fold_in(key, step)
    nan_streak: jax.Array  # int32 (): consecutive non-finite steps (on_nan=skip)
    nan_skipped: jax.Array  # int32 (): non-finite steps skipped in total
    # the objective's own float32 scalars carried from step to step (`jaxtune.train.objectives.base.initial_carry`:
    # adaptive entropy control's weight); {} for most objectives, and in a checkpoint written before there was any
    carry: dict[str, jax.Array] = {}  # noqa: RUF012 (never mutated: a step returns a new one)


def init_state(params: Any, tx: optax.GradientTransformation, seed: int,
               carry: dict[str, Any] | None = None) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        key=jax.random.key_data(jax.random.key(seed)),
        nan_streak=jnp.zeros((), jnp.int32),
        nan_skipped=jnp.zeros((), jnp.int32),
        carry={k: jnp.asarray(v, jnp.float32) for k, v in (carry or {}).items()},
    )


def state_layout(tx: optax.GradientTransformation, abstract_groups: list[Any], group_sh: list[Any], mesh: Mesh,
                 seed: int, carry: dict[str, Any] | None = None) -> tuple[TrainState, TrainState, tuple]:
    """(state shardings, abstract state, abstract frozen groups) from the parameter groups ([trainable,
    *frozen]) and their shardings: optimizer moments mirror their parameter's sharding; scalars (the objective's
    ``carry`` too) are replicated."""
    abstract_params, param_sh = abstract_groups[0], group_sh[0]
    abstract_state = jax.eval_shape(lambda: init_state(abstract_params, tx, seed, carry))
    rep = sharding.replicated(mesh)
    opt_sh = optax.tree_map_params(
        tx, lambda leaf, sh, p: sh if leaf.shape == p.shape else rep,  # factored (Adafactor) stats: replicated
        abstract_state.opt_state, param_sh, abstract_params,
        transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    shardings = TrainState(step=rep, params=param_sh, opt_state=opt_sh, key=rep, nan_streak=rep, nan_skipped=rep,
                           carry={k: rep for k in abstract_state.carry})
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    frozen = tuple(jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), g, sh)
                   for g, sh in zip(abstract_groups[1:], group_sh[1:]))
    return shardings, abstract, frozen


class ModelInfo(Protocol):
    """What the trainer reads of a model's shape (a native family config, or a torchax model's summary)."""

    family: str
    vocab_size: int
    max_seq_len: int
    n_layer: int
    d_model: int
    n_head: int
    needs_key: bool  # training draws random numbers (dropout): the step passes a key
    compute_dtype: str  # the activations' dtype
    remat: str  # what the backward pass recomputes (model.remat)

    def num_params(self, non_embedding: bool = False) -> int: ...

    def flops_per_token(self, seq_len: int) -> float: ...


class Forward(Protocol):
    """A backend's model as pure functions of its weights: what objectives call. ``batch`` holds (B, T) int32
    ``inputs`` and ``targets``, optionally ``positions`` and ``segment_ids`` (packed rows); ``key`` draws dropout
    (None: deterministic)."""

    def logits(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        """(B, T, V) float32."""
        ...

    def hidden(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        """(B, T, D): the final (normalised) hidden states the output layer reads, in the compute dtype."""
        ...

    def token_logps(self, weights: Any, batch: Batch, key: jax.Array | None = None,
                    temperature: float = 1.0) -> jax.Array:
        """(B, T) float32: log p(targets[b, t] | inputs[b, :t + 1]) under softmax(logits / temperature), without
        holding the (B, T, V) logits of a large vocabulary at once where the backend can avoid it."""
        ...

    def token_logps_and_entropy(self, weights: Any, batch: Batch, key: jax.Array | None = None,
                                temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
        """`token_logps` and (B, T) float32 entropy (nats) of each position's softmax(logits / temperature), from
        the same logits (what GRPO's entropy mask and bonus read; `token_logps` alone computes no entropy)."""
        ...

    def scores(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        """(B, T) float32: a reward model's score head at every position (a model built with ``num_labels`` 1)."""
        ...


class Sampler(Protocol):
    """Token generation for eval prompts, `jaxtune generate` and GRPO's rollouts: called with `ModelSpec.weights` and
    prompt ids; returns a `Generation`: the new ids per prompt, the stop id excluded (or, ``keep_stop``, kept as the
    last id), and each id's log-prob under the (tempered) distribution it was sampled from."""

    compiles: int
    max_seq_len: int  # the context prompt and new tokens share

    def __call__(self, weights: Any, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | list[int] | None = None,
                 seed: int = 0, on_step: Any = None, keep_stop: bool = False, group: int = 1) -> Generation:
        """``group``: the prompts come in runs of ``group`` equal ones, which a sampler may prefill once."""
        ...


class ModelSpec(Protocol):
    """A model with its optimizer, laid out on a mesh: what a backend builds and the trainer uses."""

    model_cfg: ModelInfo
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    optimizer: Any  # `jaxtune.train.optim.Optimizer`: tx and lr_schedule, and the train program's inputs
    mesh: Mesh
    shardings: TrainState  # NamedSharding per leaf
    abstract: TrainState  # ShapeDtypeStruct per leaf, with .sharding
    # Parameters that do not train (a LoRA model's base), outside the train state: never in the optimizer nor in
    # checkpoints, re-read by `load_frozen`. () without LoRA.
    frozen_abstract: tuple
    frozen_shardings: tuple

    def init(self, seed: int) -> TrainState:
        """A fresh state (initial or checkpoint weights), created sharded."""
        ...

    def load_frozen(self, seed: int) -> tuple:
        """The frozen parameter groups placed on the mesh; () without LoRA."""
        ...

    def weights(self, params: Any, frozen: tuple) -> Any:
        """What `Forward` and the sampler take: the trained params merged with the frozen groups."""
        ...

    def forward(self, loss_chunk: int = 0) -> Forward:
        """The model's functions; ``loss_chunk``: sequence positions per log-prob chunk (0: auto)."""
        ...

    def generator(self) -> Sampler: ...
