"""The frozen reference model an objective compares the policy with (DPO's anchor; `Objective.uses_reference`).

Which model it is follows from the run, as TRL does:

* **LoRA**: the frozen base with the adapters off: the policy's own forward with its adapters zeroed (`zeroed`), so
  no second copy of the weights (the base is already on the mesh as the LoRA model's frozen group) and, while the
  trained B matrices are still 0, the very program of the policy: at step 0 the reference's log-probs are bitwise the
  policy's wherever both are computed without gradients (the evaluations, the precomputed log-probs), and every
  reward is exactly 0.
* **Full fine-tuning**: a frozen copy of the initial weights (the checkpoint's, or the seed's), held on the mesh
  beside the train state as one more frozen group: the step's ``frozen`` is the model's groups, then the copy.
* **``objective.precompute_ref_logps``**: either of the above, used once before training (`precompute`) over every
  pair; the results are stored in the run directory (`REF_LOGPS_FILE`) and ride in the batches as ``ref_logps``, so
  no reference model is held while training.

The copy and the precomputed log-probs come from the initial weights, not from a resumed state, so a resumed run
compares with the same reference as the run it continues.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune import sharding
from jaxtune.config import Config, ObjectiveConfig
from jaxtune.data import make_sequence_batches
from jaxtune.data.progress import Progress
from jaxtune.train.objectives.base import Reference
from jaxtune.train.objectives.preference import flat_pairs, pair_logps
from jaxtune.train.run_dir import writing
from jaxtune.train.state import Forward, ModelSpec

REF_LOGPS_FILE = "reference_logps.npz"


@dataclass(frozen=True)
class ReferenceModel:
    """A reference as the step uses it: a forward, and where its weights are among the step's frozen groups."""

    forward: Forward | None  # None: its log-probs are precomputed, they ride in the batches
    weights: Callable[[tuple], Any]  # the step's frozen groups -> the reference's weights
    copy: bool = False  # the weights are a frozen copy, the last frozen group (else they are the model's own)
    lora: bool = False  # the reference is the model with its adapters (the trained params) zeroed
    # Another model (gkd's teacher): its weights the last frozen group, placed by ``shardings`` and read by ``load``
    # (seed -> (weights,)); never the policy
    teacher: bool = False
    shardings: Any = None
    load: Callable[[int], tuple] | None = None
    abstract: Any = None  # a teacher's params as ShapeDtypeStructs (ahead-of-time plans)

    def bind(self, params: Any, frozen: tuple) -> Reference:
        """The reference's per-token log-probs of (N, T) rows (of logits / temperature), deterministic and without
        gradient, and whether the trained ``params`` are the reference (`jaxtune.train.objectives.base.pinned`); a
        teacher's whole distributions too."""
        if self.teacher:
            weights, forward = self.weights(frozen), self.forward
            return Reference(self.logps(frozen), jnp.bool_(False), lambda rows: jax.lax.stop_gradient(
                jax.nn.log_softmax(forward.logits(weights, rows, None).astype(jnp.float32), axis=-1)))
        return Reference(self.logps(frozen), self.is_policy(params, frozen))

    def logps(self, frozen: tuple) -> Callable[..., jax.Array] | None:
        """(N, T) rows[, temperature] -> the reference's per-token log-probs; None when they are precomputed."""
        if self.forward is None:
            return None
        weights, forward = self.weights(frozen), self.forward
        return lambda rows, temperature=1.0: jax.lax.stop_gradient(forward.token_logps(weights, rows, None,
                                                                                          temperature))

    def is_policy(self, params: Any, frozen: tuple) -> jax.Array:
        """Scalar bool: the policy with ``params`` is exactly this reference. LoRA: every adapter contributes 0 (its
        B is all zeros, as before the first update); a frozen copy: every trained weight equals the
        copy's (one comparison per weight, no larger than reading them once); a full fine-tune against precomputed
        log-probs holds no copy to compare with: False."""
        if self.lora:  # native ``lora_b`` and PEFT's ``lora_B`` (torchax) alike
            checks = [jnp.all(leaf == 0) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                      if any(str(getattr(k, "key", "")).lower() == "lora_b" for k in path)]
        elif self.copy:
            checks = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.all(a == b), params, frozen[-1]))
        else:
            checks = [jnp.bool_(False)]
        return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(False)

    def model_frozen(self, frozen: tuple) -> tuple:
        """The model's own frozen groups (the copy removed)."""
        return frozen[:-1] if self.copy else frozen


def reference_model(spec: ModelSpec, loss_chunk: int = 0) -> ReferenceModel:
    """LoRA's base (the adapters zeroed) where the model has adapters (a frozen base group), else a frozen copy."""
    forward = spec.forward(loss_chunk)
    if spec.frozen_abstract:
        return ReferenceModel(forward, lambda frozen: spec.weights(zeroed(spec.abstract.params), frozen), lora=True)
    return ReferenceModel(forward, lambda frozen: frozen[-1], copy=True)


def zeroed(abstract: Any) -> Any:
    """Zeros shaped and placed like ``abstract``'s leaves (the trained adapters), behind an optimization barrier so
    that XLA cannot fold them away and compile the reference as a program other than the policy's."""
    return jax.tree.map(lambda a: jax.lax.optimization_barrier(
        jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), a.sharding)), abstract)


def step_reference(spec: ModelSpec, objective: ObjectiveConfig, loss_chunk: int = 0,
                   precomputed: bool = False) -> ReferenceModel | None:
    """The reference the steps hold: None when the objective has none; without a forward (and without a copy) when
    its log-probs are ``precomputed``."""
    if not objective.uses_reference:
        return None
    if precomputed:
        return ReferenceModel(None, lambda frozen: None, lora=bool(spec.frozen_abstract))
    return reference_model(spec, loss_chunk)


def with_reference(frozen: tuple, reference: ReferenceModel | None, spec: ModelSpec, seed: int) -> tuple:
    """The steps' frozen groups: the model's, then the reference's copy of the initial weights if it is one (a
    teacher's weights, for a teacher)."""
    if reference is None or not reference.copy:
        return frozen
    return frozen + (reference.load(seed) if reference.load is not None else load_copy(spec, seed))


def load_copy(spec: ModelSpec, seed: int) -> tuple:
    """(initial weights,): the frozen copy, placed like the trained params."""
    return (spec.init(seed).params,)


def precompute(ref: ReferenceModel, frozen: tuple, batches: Iterable[dict[str, np.ndarray]], mesh: Any,
               count: int, progress: Callable[[int], None] = lambda done: None) -> np.ndarray:
    """The reference's summed completion log-probs of pair batches, (count, 2) float32 in order (the batches' tail
    padding dropped). ``batches``: this process's rows of each global batch (`make_sequence_batches`).
    ``progress(done)``: told the pairs done after each batch."""
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


def stored_logps(run_dir: Path, splits: dict[str, Any],
                 compute: Callable[[str], np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """The reference log-probs of each split's pairs (``splits``: name -> pair source): read from the run directory
    when it holds them for exactly these pairs, else ``compute(name)`` and written (process 0) before training; and
    a line saying which."""
    path = run_dir / REF_LOGPS_FILE
    prints = {name: fingerprint(source) for name, source in splits.items()}
    sizes = ", ".join(f"{len(source)} {name}" for name, source in splits.items())
    if path.exists():
        with np.load(path, allow_pickle=False) as saved:
            if all(f"{n}_fingerprint" in saved and str(saved[f"{n}_fingerprint"]) == p for n, p in prints.items()):
                return {n: np.asarray(saved[n]) for n in splits}, f"reference log-probs of {sizes} pairs read from {path}"
    t0 = time.perf_counter()
    logps = {name: compute(name) for name in splits}
    note = f"reference log-probs of {sizes} pairs computed in {time.perf_counter() - t0:.1f} s, stored in {path}"
    if jax.process_index() == 0:
        tmp = path.with_name(path.name + ".tmp")
        with writing(tmp):
            with tmp.open("wb") as f:
                np.savez(f, **logps, **{f"{n}_fingerprint": np.array(p) for n, p in prints.items()})
            tmp.replace(path)
    return logps, note


def precompute_reference(run_dir: Path, spec: ModelSpec, cfg: Config, data: Any,
                         frozen: tuple) -> tuple[dict[str, Any], str]:
    """``objective.precompute_ref_logps``: the reference log-probs of every training and held-out pair (``data``:
    `jaxtune.data.TrainingData`, whose ``pair_sources`` name them), read from the run directory or computed there once
    with the reference model, which is then let go (a copy of the weights is loaded only while computing); and a line
    for the run log."""
    ref = reference_model(spec, cfg.train.loss_chunk)
    loaded: list[tuple] = []

    def compute(split: str) -> np.ndarray:
        if not loaded:
            loaded.append(with_reference(frozen, ref, spec, cfg.train.seed))
        source = data.pair_sources[split]
        batches = make_sequence_batches(source, batch_size=cfg.train.batch_size, num_batches=len(source),
                                        process_index=jax.process_index(), process_count=jax.process_count())
        if jax.process_index() or not cfg.logging.progress:
            return precompute(ref, loaded[0], batches, spec.mesh, len(source))
        # the first batch compiles the forward: the bar says so until it is done
        bar = Progress(f"reference log-probs of the {split} pairs (objective.precompute_ref_logps)", len(source), "",
                       unit="pairs")
        bar.update(0, "compiling the reference forward ...")
        logps = precompute(ref, loaded[0], batches, spec.mesh, len(source), bar.update)
        bar.close()
        return logps

    return stored_logps(run_dir, data.pair_sources, compute)
