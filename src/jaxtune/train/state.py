"""The train state's shape and placement, built from config before anything is allocated.

``StateSpec`` holds the model graph, the optimizer and an abstract state whose leaves carry their
shardings, so a state is created (jit with out_shardings) or restored (Orbax) directly in place on the
mesh, never as a full host copy. ``model.backend: torchax`` builds `jaxtune.torchax.state.TorchaxSpec`, which
offers the same attributes and methods (the loop, evaluation and benchmarks use only those).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxtune.config import Config, TrainConfig
from jaxtune.generate import Generator
from jaxtune.models import model_config
from jaxtune.models.registry import init_params, model_layout
from jaxtune.train import sharding
from jaxtune.train.optim import make_optimizer, schedule
from jaxtune.train.step import LossFn, TrainState, init_state, make_eval_step, make_train_step, native_loss


@dataclass(frozen=True)
class StateSpec:
    model_cfg: Any
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    mesh: Mesh
    shardings: TrainState  # NamedSharding per leaf
    abstract: TrainState  # ShapeDtypeStruct per leaf, with .sharding
    from_hf: str | None = None  # initial weights: this HuggingFace checkpoint instead of the family's init
    # Parameters that do not train (a LoRA model's base), outside the train state: never in the optimizer nor in
    # checkpoints, re-read from `from_hf` (or re-initialised from the seed) by `load_frozen`. () without LoRA.
    frozen_abstract: tuple = ()
    frozen_shardings: tuple = ()

    def init(self, seed: int) -> TrainState:
        """A fresh state, created sharded (each device computes or reads only its own shards)."""
        cfg, tx = self.model_cfg, self.tx
        params = None
        if self.from_hf and not self.frozen_abstract:  # full fine-tuning starts from the checkpoint
            params = self._read_hf(self.abstract.params, self.shardings.params)

        def make(params):
            if params is None:
                params = init_params(cfg, seed)[0]
            return init_state(params, tx, seed)

        with sharding.use_mesh(self.mesh):
            return jax.jit(make, out_shardings=self.shardings)(params)

    def load_frozen(self, seed: int) -> tuple:
        """The frozen params, placed on the mesh: the checkpoint's (``from_hf``) or the seed's initial ones."""
        if not self.frozen_abstract:
            return ()
        if self.from_hf:
            return (self._read_hf(self.frozen_abstract[0], self.frozen_shardings[0]),)
        with sharding.use_mesh(self.mesh):
            return jax.jit(lambda: tuple(init_params(self.model_cfg, seed)[1:]),
                           out_shardings=self.frozen_shardings)()

    def weights(self, params: Any, frozen: tuple) -> Any:
        """What `jaxtune.models.registry.merge` takes: ``params``, or (adapters, base) with LoRA."""
        return (params, *frozen) if frozen else params

    def loss_fn(self, loss_chunk: int = 0) -> LossFn:
        return native_loss(self.graphdef, loss_chunk)

    def generator(self) -> Generator:
        """Sampling for eval prompts and `jaxtune generate`: called with `weights` and token ids."""
        return Generator(self.graphdef, self.model_cfg.max_seq_len)

    def _read_hf(self, abstract: Any, shardings: Any) -> Any:
        from jaxtune.models.hf import HFCheckpoint, family_of, load_params

        ckpt = HFCheckpoint(self.from_hf)
        return load_params(ckpt, family_of(ckpt.config), abstract, shardings)


def make_state_spec(cfg: Config, vocab_size: int, mesh: Mesh) -> StateSpec:
    if cfg.model.backend == "torchax":
        from jaxtune.torchax.state import make_torchax_spec

        return make_torchax_spec(cfg, vocab_size, mesh)
    model_cfg = model_config(cfg.model, vocab_size)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    graphdef, abstract_groups, group_sh = model_layout(model_cfg, mesh, cfg.train.seed)
    shardings, abstract, frozen = state_layout(tx, abstract_groups, group_sh, mesh, cfg.train.seed)
    return StateSpec(model_cfg, graphdef, tx, schedule(cfg.optim, cfg.train.steps), mesh, shardings, abstract,
                     cfg.model.from_hf, frozen, tuple(group_sh[1:]))


def state_layout(tx: optax.GradientTransformation, abstract_groups: list[Any], group_sh: list[Any], mesh: Mesh,
                 seed: int) -> tuple[TrainState, TrainState, tuple]:
    """(state shardings, abstract state, abstract frozen groups) from the parameter groups ([trainable,
    *frozen]) and their shardings: optimizer moments mirror their parameter's sharding; scalars are replicated."""
    abstract_params, param_sh = abstract_groups[0], group_sh[0]
    abstract_state = jax.eval_shape(lambda: init_state(abstract_params, tx, seed))
    rep = sharding.replicated(mesh)
    opt_sh = optax.tree_map_params(
        tx, lambda leaf, sh, p: sh if leaf.shape == p.shape else rep,  # factored (Adafactor) stats: replicated
        abstract_state.opt_state, param_sh, abstract_params,
        transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    shardings = TrainState(step=rep, params=param_sh, opt_state=opt_sh, key=rep, nan_streak=rep, nan_skipped=rep)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
    frozen = tuple(jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), g, sh)
                   for g, sh in zip(abstract_groups[1:], group_sh[1:]))
    return shardings, abstract, frozen


def build_steps(spec: Any, train: TrainConfig) -> tuple[Callable, Callable]:
    """(train step, eval step), unjitted, as `train()` builds them from the spec and ``train`` config."""
    loss = spec.loss_fn(train.loss_chunk)
    step = make_train_step(loss, spec.tx, spec.lr_schedule, micro_batches=train.micro_batches,
                           skip_nonfinite=train.on_nan == "skip", use_dropout=spec.model_cfg.needs_key)
    return step, make_eval_step(loss)
