"""The pure train step ``(state, batch, frozen) -> (state, metrics)``, the eval step, and both jitted for a mesh.

A step is assembled from (model, objective, optimizer): `objective_loss` binds an objective to a model's forward;
`make_train_step` adds gradients, accumulation, the optimizer and the NaN policy; `jit_steps` compiles both steps
with the spec's shardings (state donated); `run_steps` does so for a run's config. Feature choices (accumulation,
NaN policy, dropout) are made when the step is *built*, not inside it. Training, `jaxtune eval`, `jaxtune info
--compile-for` and the benchmarks all take their steps from `jit_steps`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtune import sharding
from jaxtune.config import Config, TrainConfig
from jaxtune.train.ahead import Ahead
from jaxtune.train.objectives import Metrics, Objective, make_objective
from jaxtune.train.objectives.base import (
    combine_metrics,
    counts_of,
    extreme,
    initial_carry,
    metrics_identity,
    present,
    varies_per_pass,
    with_margins,
)
from jaxtune.train.optim import Optimizer
from jaxtune.train.reference import Companion, Frozen, frozen_of, step_reference, with_companion
from jaxtune.train.state import Batch, Forward, ModelSpec, TrainState

# (params, batch, key, frozen) -> (summed loss, (count, metric sums)): differentiable in params.
LossFn = Callable[[Any, Batch, jax.Array | None, Frozen], tuple[jax.Array, tuple[jax.Array, Metrics]]]


def bound(merge: Callable[[Any, tuple], Any], companion: Companion | None, params: Any,
          frozen: Frozen) -> tuple[Any, Any]:
    """(the model's weights: the trained ``params`` merged with the frozen groups by ``merge`` (`ModelSpec.weights`),
    the companion as the objective reads it (`jaxtune.train.objectives.base.Reference`), or None)."""
    return merge(params, frozen.model), None if companion is None else companion.bind(params, frozen)


def objective_loss(objective: Objective, forward: Forward, merge: Callable[[Any, tuple], Any],
                   companion: Companion | None = None) -> LossFn:
    """``objective`` on a model's ``forward``, with the trained ``params`` merged with the ``frozen`` groups by
    ``merge`` (`ModelSpec.weights`); ``companion``: the second model it reads (`jaxtune.train.reference`), if any.
    ``frozen``: a `Frozen`, or the model's frozen groups alone (a tuple) where there is no companion's weights."""

    def loss(params, batch, key, frozen):
        weights, companion_view = bound(merge, companion, params, frozen_of(frozen))
        total, count, metrics = objective(forward, weights, batch, key, companion_view)
        return total, (count, metrics)

    return loss


def _split_micro(batch: Batch, n: int) -> Batch:
    """(B, ...) -> (n, B/n, ...) taking every n-th row, so each micro-batch stays spread over the
    data-parallel devices (a contiguous split would put micro-batch i on a subset of them)."""
    return {k: v.reshape(v.shape[0] // n, n, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}


def per_unit(metrics: Metrics, count: jax.Array) -> dict[str, jax.Array]:
    """An objective's summed metrics as means: each sum over the loss's ``count``, or a (sum, count) pair over its
    own (NaN where that is 0: a mean of no units, never a 0 that reads as a value); an extreme (``.../max``,
    ``.../min``) as it is."""
    def mean(k: str, v: Any) -> jax.Array:
        if extreme(k):
            return v
        if isinstance(v, tuple):
            return jnp.where(v[1] > 0, v[0] / jnp.maximum(v[1], 1.0), jnp.nan)
        return v / jnp.maximum(count, 1.0)

    return {k: mean(k, v) for k, v in metrics.items()}


def accumulated(loss_fn: LossFn, micro_batches: int) -> Callable:
    """(params, batch, key, frozen) -> (loss, count, metric means, gradients) of ``loss_fn`` over the whole batch:
    with ``micro_batches`` > 1 the summed losses, counts, metric sums and gradients of each micro-batch (its dropout
    key folded with its index) are added up, then divided once by the total count (not a mean of means). A metric
    with units of its own comes with its count (`count_key`), so that the log can weigh steps by it."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def gradients(params, batch, step_key, frozen):
        if micro_batches == 1:
            (loss_sum, (count, extra)), grads = grad_fn(params, batch, step_key, frozen)
        else:
            scalars = {k: v for k, v in batch.items() if jnp.ndim(v) == 0}  # the objective's carry: in every one
            micro_batch = _split_micro({k: v for k, v in batch.items() if k not in scalars}, micro_batches)

            def micro(carry, xs):
                i, mb = xs
                key = None if step_key is None else jax.random.fold_in(step_key, i)
                (l, (n, m)), g = grad_fn(params, {**mb, **scalars}, key, frozen)
                summed = jax.tree.map(jnp.add, carry[:3], (g, l, n))
                return (*summed, combine_metrics(carry[3], m)), None

            first = {**jax.tree.map(lambda x: x[0], micro_batch), **scalars}
            aux = jax.eval_shape(lambda: loss_fn(params, first, step_key, frozen))
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (params, aux[0], aux[1][0]))
            xs = (jnp.arange(micro_batches), micro_batch)
            (grads, loss_sum, count, extra), _ = jax.lax.scan(micro, (*zeros, metrics_identity(aux[1][1])), xs)
        denom = jnp.maximum(count, 1.0)
        means = {**per_unit(extra, count), **counts_of(extra)}
        return loss_sum / denom, count, means, jax.tree.map(lambda g: g / denom, grads)

    return gradients


def repeated(update: Callable, passes: int, first_key: int, carried: Collection[str] = ()) -> Callable:
    """``update`` (params, opt_state, carry, batch, key, frozen) -> (params, opt_state, carry, (loss, count, metrics,
    grad norm, finite)) applied ``passes`` times to the same batch, pass i's dropout key folded with ``first_key`` + i:
    the first pass's loss and metrics but those measuring the update as it goes (`varies_per_pass`: clip ratios, kl),
    averaged over the passes, and those of the objective's carry (``carried``), the last pass's; finite only if every
    pass was."""
    if passes == 1:
        return update

    def run(params, opt_state, carry, batch, step_key, frozen):
        def one_pass(state, i):
            params, opt_state, carry, ok = state
            key = None if step_key is None else jax.random.fold_in(step_key, first_key + i)
            params, opt_state, carry, out = update(params, opt_state, carry, batch, key, frozen)
            return (params, opt_state, carry, ok & out[-1]), out

        (params, opt_state, carry, finite), outs = jax.lax.scan(one_pass, (params, opt_state, carry, True),
                                                                jnp.arange(passes))
        loss, count, extra, grad_norm, _ = jax.tree.map(lambda x: x[0], outs)
        extra = {k: jnp.mean(outs[2][k], axis=0) if varies_per_pass(k) else outs[2][k][-1] if k in carried else v
                 for k, v in extra.items()}
        return params, opt_state, carry, (loss, count, extra, grad_norm, finite)

    return run


def _reading(optimizer: Optimizer | None, hyper: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and schedule that read their numbers from ``hyper`` (the train program's inputs)."""
    if optimizer is None:
        raise ValueError("a train step given the optimizer's numbers needs the Optimizer that reads them")
    return optimizer.tx(hyper), optimizer.schedule(hyper)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, lr_schedule: optax.Schedule, *,
                    micro_batches: int = 1, skip_nonfinite: bool = False, use_dropout: bool = True, passes: int = 1,
                    prepare: Callable[[Any, Batch, Frozen], Batch] | None = None, objective: Any = None,
                    optimizer: Optimizer | None = None):
    """Build the step around ``loss_fn`` (`objective_loss`). The loss is weighted by the objective's count over
    the whole batch (`accumulated`); so are the objective's metrics.

    ``passes`` > 1: that many optimizer updates on the same batch (GRPO's ``num_iterations``, `repeated`).
    ``prepare(params, batch, frozen)``, when given, first annotates the whole batch with the weights as they were;
    the step's loss and metrics are the first pass's (clip ratios and kl: their mean over the passes, `repeated`),
    and the learning-rate schedule counts updates. ``objective``: the one ``loss_fn`` computes, where it carries
    scalars from update to update (``advance``; `jaxtune.train.objectives.base`): each update's loss reads the state's
    carry, which the update's metric means then advance. A non-finite pass (with ``skip_nonfinite``) keeps the state
    as it was before the step, its carry too. ``optimizer``: where the step is given the optimizer's numbers
    (``hyper``, `Optimizer.inputs`), ``tx`` and ``lr_schedule`` are made from them."""
    gradients = accumulated(loss_fn, micro_batches)
    advance = getattr(objective, "advance", None)
    carried: set[str] = set()

    def update(tx, params, opt_state, carry, batch, step_key, frozen):
        loss, count, extra, grads = gradients(params, {**batch, **carry}, step_key, frozen)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if advance is not None:
            carry, logged = advance(carry, extra)
            carried.update(logged)
            extra = {**extra, **logged}
        return optax.apply_updates(params, updates), opt_state, carry, (loss, count, extra, grad_norm, finite)

    def train_step(state: TrainState, batch: Batch, frozen: Frozen | None = None, hyper: Any = None):
        """``frozen``: weights that do not train (a LoRA base, the companion's): read, never updated, no optimizer
        state. ``hyper``: the optimizer's numbers (`Optimizer.inputs`), or None where ``tx`` holds them."""
        opt, schedule = (tx, lr_schedule) if hyper is None else _reading(optimizer, hyper)
        updates = repeated(functools.partial(update, opt), passes, micro_batches, carried)
        frozen = frozen_of(frozen)
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step) if use_dropout else None
        if prepare is not None:
            batch = prepare(state.params, batch, frozen)
        params, opt_state, carry, (loss, count, extra, grad_norm, finite) = updates(
            state.params, state.opt_state, state.carry, batch, step_key, frozen)
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            params, opt_state, carry = (keep(params, state.params), keep(opt_state, state.opt_state),
                                        keep(carry, state.carry))
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            key=state.key,
            nan_streak=jnp.where(finite, 0, state.nan_streak + 1),
            nan_skipped=state.nan_skipped + jnp.where(finite, 0, 1),
            carry=carry,
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step * passes), "count": count,
                   "finite": finite, "nan_streak": new_state.nan_streak, **extra}
        return new_state, metrics

    return train_step


def make_eval_step(loss_fn: LossFn, prepare: Callable[[Any, Batch, Frozen], Batch] | None = None,
                   carry: dict[str, float] | None = None):
    """(params, batch, frozen) -> (summed loss, count, metric sums); deterministic (no dropout). ``prepare``: what an
    objective that ``prepares`` computes from the whole batch first (KTO's KL baseline from the held-out batch's own
    mismatched rows, as TRL's evaluation does; without it the held-out loss had no baseline and ``kl`` read 0).
    ``carry``: the objective's initial carry, which every held-out batch reads (`jaxtune.train.objectives.base`)."""
    fixed = {k: jnp.asarray(v, jnp.float32) for k, v in (carry or {}).items()}

    def eval_step(params, batch, frozen=None):
        if prepare is not None:
            batch = prepare(params, batch, frozen)
        total, (count, metrics) = loss_fn(params, {**batch, **fixed}, None, frozen_of(frozen))
        return total, count, metrics

    return eval_step


def build_steps(spec: ModelSpec, objective: Objective, train: TrainConfig,
                companion: Companion | None = None) -> tuple[Callable, Callable]:
    """(train step, eval step), unjitted, from the spec, the objective, the ``train`` config and the companion model
    (`jaxtune.train.reference`) the objective reads, if any."""
    forward = spec.forward(train.loss_chunk)
    loss = objective_loss(objective, forward, spec.weights, companion)
    passes = objective.passes
    prepare = None
    if passes > 1 or objective.prepares:
        def prepare(params, batch, frozen):
            weights, companion_view = bound(spec.weights, companion, params, frozen)
            return objective.prepare(forward, weights, batch, companion_view)
    step = make_train_step(loss, spec.tx, spec.lr_schedule, micro_batches=train.micro_batches,
                           skip_nonfinite=train.on_nan == "skip", use_dropout=spec.model_cfg.needs_key, passes=passes,
                           prepare=prepare, objective=objective, optimizer=spec.optimizer)
    return step, make_eval_step(loss, prepare if objective.prepares else None, initial_carry(objective))


@dataclass
class EvalResult:
    loss: float  # summed loss / count
    count: float  # tokens (or the objective's units) counted
    # the objective's, per unit; one with units of its own that held none is absent (`present`)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Steps:
    """The train and eval steps jitted for ``spec.mesh`` (train: state donated); ``compiles`` counts traces of the
    train step."""

    spec: ModelSpec
    train: Callable  # (state, global batch, frozen) -> (state, metrics)
    eval: Callable  # (params, global batch, frozen) -> (summed loss, count, metric sums)
    companion: Companion | None = None  # the second model the objective reads, if the steps hold one
    traces: list[int] = field(default_factory=lambda: [0])
    ahead: Ahead | None = None  # programs being compiled ahead of their first dispatch (`jaxtune.train.ahead`)

    @property
    def compiles(self) -> int:
        return self.traces[0]

    def frozen(self, model: tuple, seed: int) -> Frozen:
        """The steps' frozen weights: the model's frozen groups (`ModelSpec.load_frozen`), and the companion's
        weights where it holds some (a copy of the initial weights of ``seed``, a teacher's)."""
        return with_companion(model, self.companion, seed)

    def abstract_frozen(self) -> Frozen:
        """`frozen` as ShapeDtypeStructs (ahead-of-time plans)."""
        held = self.companion is not None and self.companion.holds_weights
        return Frozen(self.spec.frozen_abstract, self.companion.abstract if held else None)

    def frozen_shardings(self) -> Frozen:
        """Where `frozen`'s arrays are placed: the model's frozen groups as they are, the companion's own."""
        held = self.companion is not None and self.companion.holds_weights
        return Frozen(self.spec.frozen_shardings, self.companion.shardings if held else None)

    def weights(self, params: Any, frozen: Frozen) -> Any:
        """The model's weights (`ModelSpec.weights`) from the steps' frozen groups: what the sampler takes."""
        return self.spec.weights(params, frozen_of(frozen).model)

    def evaluate(self, params: Any, frozen: Frozen, batches: Iterable[dict[str, Any]]) -> EvalResult:
        """The objective over host ``batches`` (each this process's rows), summed and divided once by the total
        count: the one held-out loss training and `jaxtune eval` report. Call inside ``sharding.use_mesh``."""
        total = count = 0.0
        sums: dict[str, Any] = {}
        for b in batches:
            if self.ahead is not None:
                self.ahead.wait(eval_key(b))
            s, n, m = jax.device_get(self.eval(params, sharding.global_batch(self.spec.mesh, b), frozen_of(frozen)))
            total, count = total + float(s), count + float(n)
            sums = m if not sums else combine_metrics(sums, m)
        denom = max(count, 1.0)
        means = {k: float(v) for k, v in {**per_unit(sums, denom), **counts_of(sums)}.items()}
        return EvalResult(total / denom, count, with_margins(present(means)))


def eval_key(batch: dict[str, Any]) -> tuple:
    """What the eval step compiles one program per: its host batch's keys and shapes."""
    return ("eval",) + tuple(sorted((k, np.shape(v)) for k, v in batch.items()))


class WithInputs:
    """The jitted train step called (and lowered) with the optimizer's numbers as its last argument (`Optimizer
    .inputs`, host scalars that each call places; None where the program holds them as constants): ``(state, batch,
    frozen)`` as before."""

    def __init__(self, jitted: Any, inputs: Any):
        self.jitted, self.inputs = jitted, inputs

    def __call__(self, state: TrainState, batch: Batch, frozen: Any = None) -> tuple[TrainState, Metrics]:
        return self.jitted(state, batch, frozen, self.inputs)

    def lower(self, state: Any, batch: Any, frozen: Any = None) -> Any:
        return self.jitted.lower(state, batch, frozen, self.inputs)


def jit_steps(spec: ModelSpec, objective: Objective, train: TrainConfig,
              companion: Companion | None = None) -> Steps:
    """`build_steps` jitted once with explicit shardings: batches over the data axes, state donated, the frozen
    weights (`Frozen`) placed as the model's groups and the companion's own weights are."""
    step_impl, eval_impl = build_steps(spec, objective, train, companion)
    steps = Steps(spec, None, None, companion)

    def counted_step(state, batch, frozen, hyper):
        steps.traces[0] += 1
        return step_impl(state, batch, frozen, hyper)

    mesh = spec.mesh
    batch_sh = sharding.batch_sharding(mesh)
    frozen_sh = steps.frozen_shardings()
    jitted = jax.jit(counted_step, in_shardings=(spec.shardings, batch_sh, frozen_sh, sharding.replicated(mesh)),
                     out_shardings=(spec.shardings, sharding.replicated(mesh)), donate_argnums=0)
    steps.train = WithInputs(jitted, spec.optimizer.inputs if spec.optimizer is not None else None)
    steps.eval = jax.jit(eval_impl, in_shardings=(spec.shardings.params, batch_sh, frozen_sh))
    return steps


def run_steps(spec: ModelSpec, cfg: Config, companion: Companion | None = None) -> Steps:
    """The run's steps as `train()` jits them: ``cfg``'s objective and the companion it reads: the reference model
    built here from the policy (none when its log-probs are precomputed), or one loaded from outside and given as
    ``companion`` (a teacher: `jaxtune.companions.loaded_companion`). `jaxtune info --compile-for` compiles this same
    train step ahead of time."""
    objective = cfg.objective
    if companion is None and objective.spec.companion == "teacher":
        raise ValueError(f"objective.name={objective.name}: the steps need its teacher model "
                         "(jaxtune.companions.loaded_companion)")
    if companion is None:
        precomputed = objective.uses_reference and getattr(objective, "precompute_ref_logps", False)
        companion = step_reference(spec, objective, cfg.train.loss_chunk, precomputed)
    return jit_steps(spec, make_objective(objective), cfg.train, companion)
