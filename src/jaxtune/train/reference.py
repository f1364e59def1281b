"""The companion model an objective reads beside the policy (`jaxtune.config.kinds.ObjectiveKind.companion`), and
the frozen weights the steps take (`Frozen`).

A reference model (DPO's anchor, GRPO's KL penalty) follows from the run, as TRL's does; each case is one type:

* `AdaptersOff` (LoRA): the frozen base with the adapters off: the policy's own forward with its adapters zeroed
  (`zeroed`), so no second copy of the weights (the base is already on the mesh as the LoRA model's frozen group) and,
  while the trained B matrices are still 0, the very program of the policy: at step 0 the reference's log-probs are
  bitwise the policy's wherever both are computed without gradients (the evaluations, the precomputed log-probs), and
  every reward is exactly 0.
* `FrozenCopy` (full fine-tuning): a frozen copy of the initial weights (the checkpoint's, or the seed's), held on the
  mesh beside the train state as `Frozen.companion`.
* `Precomputed` (``objective.precompute_ref_logps``): either of the above, used once before training (`precompute`)
  over every pair; the results are stored in the run directory (`REF_LOGPS_FILE`) and ride in the batches as
  ``ref_logps``, so no reference model is held while training.

A `Teacher` (GKD's) is another model, loaded by its backend (`jaxtune.companions`), whose weights are
`Frozen.companion` and whose whole next-token distributions the objective reads.

The copy and the precomputed log-probs come from the initial weights, not from a resumed state, so a resumed run
compares with the same reference as the run it continues. The exception is a copy that `ReferenceSync` moves towards
the policy (TR-DPO, ``objective.sync_ref_model``): it is state, saved with each checkpoint and read back on resume.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune import sharding
from jaxtune.config import Config, ConfigError, ObjectiveConfig
from jaxtune.data import make_sequence_batches
from jaxtune.data.progress import Progress
from jaxtune.job.run_dir import writing
from jaxtune.train.objectives.base import Reference
from jaxtune.train.objectives.preference import flat_pairs, pair_logps
from jaxtune.train.state import Forward, ModelSpec

REF_LOGPS_FILE = "reference_logps.npz"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Frozen:
    """The weights a step reads and never trains: the model's own frozen groups (a LoRA base; () without LoRA) and
    the companion's weights where it holds some (a `FrozenCopy`'s, a `Teacher`'s; else None)."""

    model: tuple = ()
    companion: Any = None


def frozen_of(model: Any) -> Frozen:
    """``model`` as the steps' `Frozen`: a `Frozen` as it is; the model's frozen groups (a tuple) without a
    companion's weights; None: nothing frozen."""
    return model if isinstance(model, Frozen) else Frozen(tuple(model or ()))


def token_logps(forward: Forward, weights: Any) -> Callable[..., jax.Array]:
    """(N, T) rows[, temperature] -> (N, T) float32 log p(targets) of the model with ``weights`` (of logits /
    temperature), deterministic and without gradient."""
    return lambda rows, temperature=1.0: jax.lax.stop_gradient(forward.token_logps(weights, rows, None, temperature))


def adapters_are_zero(params: Any) -> jax.Array:
    """Scalar bool: every LoRA adapter contributes 0 (its B is all zeros, as before the first update); native
    ``lora_b`` and PEFT's ``lora_B`` (torchax) alike."""
    checks = [jnp.all(leaf == 0) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
              if any(str(getattr(k, "key", "")).lower() == "lora_b" for k in path)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(False)


@dataclass(frozen=True)
class Companion:
    """What every companion type answers: whether it holds weights of its own (then `load` places them, `shardings`
    and `abstract` describe them for the jitted steps and the TPU plan), and `bind`: the `Reference` an objective
    reads, for the trained ``params`` and the steps' frozen weights."""

    holds_weights = False

    def bind(self, params: Any, frozen: Frozen) -> Reference:
        raise NotImplementedError

    def load(self, seed: int) -> Any:
        """The companion's weights placed on the mesh (None when it holds none)."""
        return None

    @property
    def shardings(self) -> Any:
        return None

    @property
    def abstract(self) -> Any:
        return None


@dataclass(frozen=True)
class AdaptersOff(Companion):
    """LoRA's reference: the policy's forward over its frozen base with the adapters zeroed (no weights of its own)."""

    forward: Forward
    spec: ModelSpec

    def logps(self, frozen: Frozen) -> Callable[..., jax.Array]:
        return token_logps(self.forward, self.spec.weights(zeroed(self.spec.abstract.params), frozen.model))

    def bind(self, params: Any, frozen: Frozen) -> Reference:
        return Reference(self.logps(frozen), adapters_are_zero(params))


@dataclass(frozen=True)
class FrozenCopy(Companion):
    """Full fine-tuning's reference: a frozen copy of the initial weights, `Frozen.companion`, placed like the
    trained params."""

    forward: Forward
    spec: ModelSpec
    holds_weights = True

    def logps(self, frozen: Frozen) -> Callable[..., jax.Array]:
        return token_logps(self.forward, frozen.companion)

    def bind(self, params: Any, frozen: Frozen) -> Reference:
        # the policy is the reference where every trained weight equals the copy's (one comparison per weight)
        same = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.all(a == b), params, frozen.companion))
        return Reference(self.logps(frozen), jnp.all(jnp.stack(same)) if same else jnp.bool_(False))

    def load(self, seed: int) -> Any:
        return self.spec.init(seed).params

    @property
    def shardings(self) -> Any:
        return self.spec.shardings.params

    @property
    def abstract(self) -> Any:
        return self.spec.abstract.params


@dataclass(frozen=True)
class Precomputed(Companion):
    """A reference whose log-probs were computed once before training and ride in the batches (``ref_logps``); with
    ``adapters`` (LoRA) the policy is still known to be the reference while every adapter is zero."""

    adapters: bool = False

    def bind(self, params: Any, frozen: Frozen) -> Reference:
        return Reference(None, adapters_are_zero(params) if self.adapters else jnp.bool_(False))


@dataclass(frozen=True)
class Teacher(Companion):
    """Another model (GKD's teacher) on the policy's mesh, frozen: its weights `Frozen.companion`, read by ``loader``
    (seed -> weights) and described by ``param_shardings`` / ``param_abstract``; never the policy."""

    forward: Forward
    loader: Callable[[int], Any]
    param_shardings: Any
    param_abstract: Any
    holds_weights = True

    def bind(self, params: Any, frozen: Frozen) -> Reference:
        weights, forward = frozen.companion, self.forward
        distributions = lambda rows: jax.lax.stop_gradient(
            jax.nn.log_softmax(forward.logits(weights, rows, None).astype(jnp.float32), axis=-1))
        return Reference(token_logps(forward, weights), jnp.bool_(False), distributions)

    def load(self, seed: int) -> Any:
        return self.loader(seed)

    @property
    def shardings(self) -> Any:
        return self.param_shardings

    @property
    def abstract(self) -> Any:
        return self.param_abstract


def reference_model(spec: ModelSpec, loss_chunk: int = 0) -> AdaptersOff | FrozenCopy:
    """LoRA's base (the adapters zeroed) where the model has adapters (a frozen base group), else a frozen copy."""
    forward = spec.forward(loss_chunk)
    return AdaptersOff(forward, spec) if spec.frozen_abstract else FrozenCopy(forward, spec)


def zeroed(abstract: Any) -> Any:
    """Zeros shaped and placed like ``abstract``'s leaves (the trained adapters), behind an optimization barrier so
    that XLA cannot fold them away and compile the reference as a program other than the policy's."""
    return jax.tree.map(lambda a: jax.lax.optimization_barrier(
        jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), a.sharding)), abstract)


def step_reference(spec: ModelSpec, objective: ObjectiveConfig, loss_chunk: int = 0,
                   precomputed: bool = False) -> Companion | None:
    """The reference the steps hold: None when the objective has none; `Precomputed` when its log-probs are."""
    if not objective.uses_reference:
        return None
    if precomputed:
        return Precomputed(adapters=bool(spec.frozen_abstract))
    return reference_model(spec, loss_chunk)


def with_companion(model: tuple, companion: Companion | None, seed: int) -> Frozen:
    """The steps' frozen weights: the model's frozen groups, and the companion's weights if it holds some (a copy of
    the initial weights, a teacher's)."""
    held = companion is not None and companion.holds_weights
    return Frozen(tuple(model), companion.load(seed) if held else None)


def mixed(alpha: float, reference: Any, params: Any) -> Any:
    """alpha x ``params`` + (1 - alpha) x ``reference``, weight by weight, computed in float32 and kept in the
    reference's dtype (a bfloat16 copy is rounded once, not after each product)."""
    f32 = jnp.float32
    return jax.tree.map(lambda r, p: (alpha * p.astype(f32) + (1.0 - alpha) * r.astype(f32)).astype(r.dtype),
                        reference, params)


@dataclass(frozen=True)
class ReferenceSync:
    """TR-DPO's reference updates (``objective.sync_ref_model``, arXiv 2404.09656): after every ``every`` optimizer
    updates, the frozen copy becomes ``alpha`` x policy + (1 - ``alpha``) x itself. It keeps its own schedule
    (`due`) and one program (`mix`, jitted once on the copy's shardings with the old copy donated: the update stays
    on the devices and one copy is held). The mixed copy is no longer the seed's, so it is state: each checkpoint
    saves it and a resumed run restores it into ``abstract``'s shardings."""

    alpha: float
    every: int
    passes: int  # optimizer updates per step (GRPO's num_iterations), what ``every`` counts
    mix: Callable[[Any, Any], Any]  # (reference, params) -> the mixed reference
    abstract: Any  # the copy's ShapeDtypeStructs, with their shardings
    traces: list[int] = field(default_factory=lambda: [0])

    @property
    def compiles(self) -> int:
        return self.traces[0]

    def due(self, step: int) -> bool:
        """Whether one of step ``step``'s optimizer updates is a multiple of ``every`` (TRL syncs right after that
        update; here after the step that holds it, before the step's evaluation and save)."""
        return step * self.passes // self.every > (step - 1) * self.passes // self.every

    def __call__(self, frozen: Frozen, params: Any) -> Frozen:
        """``frozen`` with its reference copy mixed with the trained ``params`` (the old copy is donated)."""
        return Frozen(frozen.model, self.mix(frozen.companion, params))

    def note(self, step: int) -> str:
        """The run log's line for a sync after step ``step``."""
        return (f"step {step}: ref_sync: reference = {self.alpha:g} x policy + {1 - self.alpha:g} x reference "
                f"(objective.sync_ref_model, every {self.every} updates)")


def reference_sync(objective: ObjectiveConfig, companion: Companion | None) -> ReferenceSync | None:
    """The run's `ReferenceSync`, None without ``objective.sync_ref_model``. Only a frozen copy can be mixed (the
    config refuses LoRA and precomputed log-probs with it)."""
    if not objective.syncs_reference:
        return None
    if not isinstance(companion, FrozenCopy):
        held = type(companion).__name__
        raise ConfigError(f"objective.sync_ref_model=true needs a frozen reference copy, not {held}; train every "
                          "weight (model.lora.rank=0), with objective.precompute_ref_logps=false")
    alpha, traces, shardings = objective.ref_model_mixup_alpha, [0], companion.shardings

    def counted(reference, params):
        traces[0] += 1
        return mixed(alpha, reference, params)

    program = jax.jit(counted, in_shardings=(shardings, shardings), out_shardings=shardings, donate_argnums=0)
    return ReferenceSync(alpha, objective.ref_model_sync_steps, objective.passes, program, companion.abstract, traces)


def precompute(ref: AdaptersOff | FrozenCopy, frozen: Frozen, batches: Iterable[dict[str, np.ndarray]], mesh: Any,
               count: int, progress: Callable[[int], None] = lambda done: None) -> np.ndarray:
    """The reference's summed completion log-probs of pair batches, (count, 2) float32 in order (the batches' tail
    padding dropped). ``batches``: this process's rows of each global batch (`make_sequence_batches`).
    ``progress(done)``: told the items (pairs, rows) done after each batch."""
    step = jax.jit(lambda frozen, batch: pair_logps(ref.logps(frozen)(flat_pairs(batch)), batch)[0],
                   out_shardings=sharding.replicated(mesh))
    out: list[np.ndarray] = []
    with sharding.use_mesh(mesh):
        for b in batches:
            out.append(np.asarray(jax.device_get(step(frozen, sharding.global_batch(mesh, b)))))
            progress(min(count, sum(len(o) for o in out)))
    return np.concatenate(out, axis=0)[:count].astype(np.float32) if out else np.zeros((0, 2), np.float32)


def fingerprint(source: Any) -> str:
    """What the stored log-probs were computed for: a hash of every pair's tokens and mask, in order."""
    h = hashlib.sha256()
    for i in range(len(source)):
        item = source[i]
        for k in ("inputs", "targets", "loss_mask"):
            h.update(np.ascontiguousarray(item[k]).tobytes())
    return h.hexdigest()


def stored_logps(run_dir: Path, splits: dict[str, Any], compute: Callable[[str], np.ndarray],
                 noun: str) -> tuple[dict[str, np.ndarray], str]:
    """The reference log-probs of each split's items (``splits``: name -> item source; ``noun``: what an item is,
    pairs or rows): read from the run directory when it holds them for exactly these items, else ``compute(name)``
    and written (process 0) before training; and a line saying which."""
    path = run_dir / REF_LOGPS_FILE
    prints = {name: fingerprint(source) for name, source in splits.items()}
    sizes = ", ".join(f"{len(source)} {name}" for name, source in splits.items())
    if path.exists():
        with np.load(path, allow_pickle=False) as saved:
            if all(f"{n}_fingerprint" in saved and str(saved[f"{n}_fingerprint"]) == p for n, p in prints.items()):
                read = {n: np.asarray(saved[n]) for n in splits}
                return read, f"reference log-probs of {sizes} {noun} read from {path}"
    t0 = time.perf_counter()
    logps = {name: compute(name) for name in splits}
    note = f"reference log-probs of {sizes} {noun} computed in {time.perf_counter() - t0:.1f} s, stored in {path}"
    if jax.process_index() == 0:
        tmp = path.with_name(path.name + ".tmp")
        with writing(tmp):
            with tmp.open("wb") as f:
                np.savez(f, **logps, **{f"{n}_fingerprint": np.array(p) for n, p in prints.items()})
            tmp.replace(path)
    return logps, note


def precompute_reference(run_dir: Path, spec: ModelSpec, cfg: Config, data: Any,
                         frozen: tuple) -> tuple[dict[str, Any], str]:
    """``objective.precompute_ref_logps``: the reference log-probs of every training and held-out item, a preference
    pair or an unpaired row with its KL row (``data``: `jaxtune.data.TrainingData`, whose ``pair_sources`` name
    them), read from the run directory or computed there once with the reference model, which is then let go (a copy
    of the weights is loaded only while computing); and a line for the run log."""
    ref = reference_model(spec, cfg.train.loss_chunk)
    loaded: list[tuple] = []
    noun = cfg.data.kind.unit  # pairs, or unpaired rows

    def compute(split: str) -> np.ndarray:
        if not loaded:
            loaded.append(with_companion(frozen, ref, cfg.train.seed))
        source = data.pair_sources[split]
        batches = make_sequence_batches(source, batch_size=cfg.train.batch_size, num_batches=len(source),
                                        process_index=jax.process_index(), process_count=jax.process_count())
        if jax.process_index() or not cfg.logging.progress:
            return precompute(ref, loaded[0], batches, spec.mesh, len(source))
        # the first batch compiles the forward: the bar says so until it is done
        bar = Progress(f"reference log-probs of the {split} {noun} (objective.precompute_ref_logps)", len(source), "",
                       unit=noun)
        bar.update(0, "compiling the reference forward ...")
        logps = precompute(ref, loaded[0], batches, spec.mesh, len(source), bar.update)
        bar.close()
        return logps

    return stored_logps(run_dir, data.pair_sources, compute, noun)
