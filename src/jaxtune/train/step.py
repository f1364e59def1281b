"""The pure train step ``(state, batch, frozen) -> (state, metrics)``, the eval step, and both jitted for a mesh.

A step is assembled from (model, objective, optimizer): `objective_loss` binds an objective to a model's forward;
`make_train_step` adds gradients, accumulation, the optimizer and the NaN policy; `jit_steps` compiles both steps
with the spec's shardings (state donated); `run_steps` does so for a run's config. Feature choices (accumulation,
NaN policy, dropout) are made when the step is *built*, not inside it. Training, `jaxtune eval`, `jaxtune info
--compile-for` and the benchmarks all take their steps from `jit_steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxtune import sharding
from jaxtune.config import Config, TrainConfig
from jaxtune.train.objectives import Metrics, Objective, make_objective
from jaxtune.train.objectives.base import combine_metrics, extreme, metrics_identity
from jaxtune.train.reference import ReferenceModel, step_reference
from jaxtune.train.state import Batch, Forward, ModelSpec, TrainState

# (params, batch, key, frozen) -> (summed loss, (count, metric sums)): differentiable in params.
LossFn = Callable[[Any, Batch, jax.Array | None, tuple], tuple[jax.Array, tuple[jax.Array, Metrics]]]


def objective_loss(objective: Objective, forward: Forward, weights: Callable[[Any, tuple], Any],
                   reference: ReferenceModel | None = None) -> LossFn:
    """``objective`` on a model's ``forward``, with the trained ``params`` merged with the ``frozen`` groups by
    ``weights`` (`ModelSpec.weights`); ``reference``: the frozen model it compares with, if any (its copy, if it has
    one, is the last frozen group)."""

    def loss(params, batch, key, frozen):
        model_frozen = frozen if reference is None else reference.model_frozen(frozen)
        ref = None if reference is None else reference.bind(params, frozen)
        total, count, metrics = objective(forward, weights(params, model_frozen), batch, key, ref)
        return total, (count, metrics)

    return loss


def _split_micro(batch: Batch, n: int) -> Batch:
    """(B, ...) -> (n, B/n, ...) taking every n-th row, so each micro-batch stays spread over the
    data-parallel devices (a contiguous split would put micro-batch i on a subset of them)."""
    return {k: v.reshape(v.shape[0] // n, n, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}


def per_unit(metrics: Metrics, count: jax.Array) -> dict[str, jax.Array]:
    """An objective's summed metrics as means: each sum over the loss's ``count``, or a (sum, count) pair over its
    own; an extreme (``.../max``, ``.../min``) as it is."""
    return {k: v if extreme(k) else v[0] / jnp.maximum(v[1], 1.0) if isinstance(v, tuple)
            else v / jnp.maximum(count, 1.0) for k, v in metrics.items()}


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, lr_schedule: optax.Schedule, *,
                    micro_batches: int = 1, skip_nonfinite: bool = False, use_dropout: bool = True, passes: int = 1,
                    prepare: Callable[[Any, Batch, tuple], Batch] | None = None):
    """Build the step around ``loss_fn`` (`objective_loss`). The loss is weighted by the objective's count over
    the whole batch: gradients of summed losses are accumulated over micro-batches and divided once by the total
    count (not a mean of means); so are the objective's metrics.

    ``passes`` > 1: that many optimizer updates on the same batch (GRPO's ``num_iterations``). ``prepare(params,
    batch, frozen)``, when given, first annotates the whole batch with the weights as they were; the step's loss and metrics are the
    first pass's, and the learning-rate schedule counts updates. A non-finite pass (with ``skip_nonfinite``) keeps
    the state as it was before the step."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def gradients(params, batch, step_key, frozen):
        """(summed loss, count, metric sums), and the gradients divided by the count."""
        if micro_batches == 1:
            (loss_sum, (count, extra)), grads = grad_fn(params, batch, step_key, frozen)
        else:
            micro_batch = _split_micro(batch, micro_batches)

            def micro(carry, xs):
                i, mb = xs
                key = None if step_key is None else jax.random.fold_in(step_key, i)
                (l, (n, m)), g = grad_fn(params, mb, key, frozen)
                summed = jax.tree.map(jnp.add, carry[:3], (g, l, n))
                return (*summed, combine_metrics(carry[3], m)), None

            first = jax.tree.map(lambda x: x[0], micro_batch)
            aux = jax.eval_shape(lambda: loss_fn(params, first, step_key, frozen))
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (params, aux[0], aux[1][0]))
            xs = (jnp.arange(micro_batches), micro_batch)
            (grads, loss_sum, count, extra), _ = jax.lax.scan(micro, (*zeros, metrics_identity(aux[1][1])), xs)
        denom = jnp.maximum(count, 1.0)
        return loss_sum / denom, count, per_unit(extra, count), jax.tree.map(lambda g: g / denom, grads)

    def update(params, opt_state, batch, step_key, frozen):
        loss, count, extra, grads = gradients(params, batch, step_key, frozen)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        return optax.apply_updates(params, updates), opt_state, (loss, count, extra, grad_norm, finite)

    def train_step(state: TrainState, batch: Batch, frozen: tuple = ()):
        """``frozen``: parameters that do not train (a LoRA base): read, never updated, no optimizer state."""
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step) if use_dropout else None
        if prepare is not None:
            batch = prepare(state.params, batch, frozen)
        if passes == 1:
            params, opt_state, (loss, count, extra, grad_norm, finite) = update(
                state.params, state.opt_state, batch, step_key, frozen)
        else:

            def one_pass(carry, i):
                params, opt_state, ok = carry
                key = None if step_key is None else jax.random.fold_in(step_key, micro_batches + i)
                params, opt_state, out = update(params, opt_state, batch, key, frozen)
                return (params, opt_state, ok & out[-1]), out

            (params, opt_state, finite), outs = jax.lax.scan(one_pass, (state.params, state.opt_state, True),
                                                             jnp.arange(passes))
            loss, count, extra, grad_norm, _ = jax.tree.map(lambda x: x[0], outs)
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            key=state.key,
            nan_streak=jnp.where(finite, 0, state.nan_streak + 1),
            nan_skipped=state.nan_skipped + jnp.where(finite, 0, 1),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state.step * passes), "count": count,
                   "finite": finite, "nan_streak": new_state.nan_streak, **extra}
        return new_state, metrics

    return train_step


def make_eval_step(loss_fn: LossFn):
    """(params, batch, frozen=()) -> (summed loss, count, metric sums); deterministic (no dropout)."""

    def eval_step(params, batch, frozen=()):
        total, (count, metrics) = loss_fn(params, batch, None, frozen)
        return total, count, metrics

    return eval_step


def build_steps(spec: ModelSpec, objective: Objective, train: TrainConfig,
                reference: ReferenceModel | None = None) -> tuple[Callable, Callable]:
    """(train step, eval step), unjitted, from the spec, the objective, the ``train`` config and the reference model
    (`jaxtune.train.reference`) the objective compares with, if any."""
    forward = spec.forward(train.loss_chunk)
    loss = objective_loss(objective, forward, spec.weights, reference)
    passes = objective.passes
    prepare = None
    if passes > 1 or getattr(objective, "prepares", False):  # an objective written before `prepares` has none
        def prepare(params, batch, frozen):
            model_frozen = frozen if reference is None else reference.model_frozen(frozen)
            ref = None if reference is None else reference.bind(params, frozen)
            return objective.prepare(forward, spec.weights(params, model_frozen), batch, ref)
    step = make_train_step(loss, spec.tx, spec.lr_schedule, micro_batches=train.micro_batches,
                           skip_nonfinite=train.on_nan == "skip", use_dropout=spec.model_cfg.needs_key, passes=passes,
                           prepare=prepare)
    return step, make_eval_step(loss)


@dataclass
class EvalResult:
    loss: float  # summed loss / count
    count: float  # tokens (or the objective's units) counted
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's, per unit


@dataclass
class Steps:
    """The train and eval steps jitted for ``spec.mesh`` (train: state donated); ``compiles`` counts traces of the
    train step."""

    spec: ModelSpec
    train: Callable  # (state, global batch, frozen) -> (state, metrics)
    eval: Callable  # (params, global batch, frozen) -> (summed loss, count, metric sums)
    reference: ReferenceModel | None = None  # the frozen model the objective compares with, if the steps hold one
    traces: list[int] = field(default_factory=lambda: [0])

    @property
    def compiles(self) -> int:
        return self.traces[0]

    def weights(self, params: Any, frozen: tuple) -> Any:
        """The model's weights (`ModelSpec.weights`) from the steps' frozen groups (a reference copy left out): what
        the sampler takes."""
        return self.spec.weights(params, frozen if self.reference is None else self.reference.model_frozen(frozen))

    def evaluate(self, params: Any, frozen: tuple, batches: Iterable[dict[str, Any]]) -> EvalResult:
        """The objective over host ``batches`` (each this process's rows), summed and divided once by the total
        count: the one held-out loss training and `jaxtune eval` report. Call inside ``sharding.use_mesh``."""
        total = count = 0.0
        sums: dict[str, Any] = {}
        for b in batches:
            s, n, m = jax.device_get(self.eval(params, sharding.global_batch(self.spec.mesh, b), frozen))
            total, count = total + float(s), count + float(n)
            sums = m if not sums else combine_metrics(sums, m)
        denom = max(count, 1.0)
        return EvalResult(total / denom, count, {k: float(v) for k, v in per_unit(sums, denom).items()})


def jit_steps(spec: ModelSpec, objective: Objective, train: TrainConfig,
              reference: ReferenceModel | None = None) -> Steps:
    """`build_steps` jitted once with explicit shardings: batches over the data axes, state donated. With a
    reference that is a frozen copy, the steps' ``frozen`` is the model's groups then the copy (placed like the
    params)."""
    step_impl, eval_impl = build_steps(spec, objective, train, reference)
    steps = Steps(spec, None, None, reference)

    def counted_step(state, batch, frozen):
        steps.traces[0] += 1
        return step_impl(state, batch, frozen)

    mesh = spec.mesh
    batch_sh = sharding.batch_sharding(mesh)
    copy_sh = None if reference is None or not reference.copy else \
        reference.shardings if reference.shardings is not None else spec.shardings.params
    frozen_sh = spec.frozen_shardings + ((copy_sh,) if copy_sh is not None else ())
    steps.train = jax.jit(counted_step, in_shardings=(spec.shardings, batch_sh, frozen_sh),
                          out_shardings=(spec.shardings, sharding.replicated(mesh)), donate_argnums=0)
    steps.eval = jax.jit(eval_impl, in_shardings=(spec.shardings.params, batch_sh, frozen_sh))
    return steps


def run_steps(spec: ModelSpec, cfg: Config, teacher: ReferenceModel | None = None) -> Steps:
    """The run's steps as `train()` jits them: ``cfg``'s objective, and the reference model it compares with, if
    the steps hold one (not when its log-probs are precomputed), or gkd's ``teacher`` (`jaxtune.backends.teacher`).
    `jaxtune info --compile-for` compiles this same train step ahead of time."""
    if cfg.objective.name == "gkd" and teacher is None:
        raise ValueError("objective.name=gkd: the steps need the teacher model (jaxtune.backends.teacher)")
    precomputed = cfg.objective.uses_reference and cfg.objective.precompute_ref_logps
    reference = teacher if teacher is not None else step_reference(spec, cfg.objective, cfg.train.loss_chunk,
                                                                     precomputed)
    return jit_steps(spec, make_objective(cfg.objective), cfg.train, reference)
