"""Rollouts sampled while the learner trains (``objective.max_staleness`` = k ≥ 1): off-policy RL with a bound.

Step s trains on the rollout of step s (its prompts, seed and layout exactly the on-policy loop's), sampled with the
weights of update v(s) = max(0, s - 1 - k) instead of s - 1. The order of the work is fixed, so a run is a function
of its config, however long each part takes:

* before the first step, the rollouts of steps 1 .. k are sampled (with the starting weights);
* iteration n takes rollout n (sampled earlier), copies the weights w_{n-1} the learner is about to update (the
  train step donates its state), and samples rollout n + k with the copy beside train step n (`Lagged.advance`).

On the devices the learner uses, the completions are generated first and train step n is dispatched as soon as they
are on the host (JAX returns at once), so the host's share of the rollout (the rewards, the layout) runs while the
step does; the devices run one program at a time, as on-policy. With ``mesh.rollout`` devices of its own the
sampler runs there, beside the step: the copy of the weights it samples with is moved there device to device
(`jax.device_put`; with several processes, gathered whole on the learner's devices and each process's replica copied
to its own sampler devices), the frozen ones (a LoRA base) once, and the reward models live there too. Every
process does the same things in the same order, so their collectives line up as in the on-policy loop.

The loss corrects for the lag with the sampler's log-probs (`jaxtune.config.objectives`: grpo's
``importance_sampling`` defaults to token_truncate, rloo's ratio takes them as the old policy's). Each step logs
``staleness``: the updates between the weights that sampled its batch and the learner's.

Resume: a checkpoint after step S holds, beside the state, the trained params that sampled the rollouts of steps
S + 1 .. S + k still to train on (`Checkpointer.save`'s ``behind``), and the data position from before the first of
them was read. A resumed run samples them again from those, with their seeds, so it trains on the very rollouts the
interrupted run would have (bitwise). k copies of the trained params are held (LoRA: the adapters only).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtune import sharding
from jaxtune.rollout.rollout import Rollout
from jaxtune.train.reference import Frozen

Batch = dict[str, Any]


@dataclass
class Pending:
    """A rollout sampled ahead of the step that trains on it."""

    step: int  # the step that trains on it
    version: int  # the update whose weights sampled it (0: the starting weights)
    params: Any  # those trained params (a copy; LoRA: the adapters)
    position: dict[str, Any]  # the data position before its prompts were read
    batch: Batch
    sampled: dict[str, float]  # its rollout metrics


def copied(params: Any) -> Any:
    """A copy of ``params`` on their devices, which a later donation of the originals leaves alone."""
    return jax.tree.map(jnp.copy, params)


@dataclass
class Lagged:
    """The rollouts of the next ``k`` steps, sampled ahead (see the module)."""

    k: int
    total: int  # the run's last step: nothing is sampled past it
    rollout: Rollout
    weights: Callable[[Any, Frozen], Any]  # (trained params, frozen) -> what the sampler takes (`Steps.weights`)
    data: Any  # `TrainingData`: its prompt source and train iterator
    mesh: Mesh | None = None  # mesh.rollout: the sampler's own devices (None: the learner's)
    pending: deque[Pending] | None = None
    _frozen: tuple[Any, Frozen] | None = None  # (the learner's frozen model weights, their copy on ``mesh``)

    def place(self, params: Any) -> Any:
        """A copy of the trained ``params`` where the sampler runs: on its own devices (`jax.device_put`, device to
        device), or beside them; a later donation of the originals leaves it alone."""
        if self.mesh is None:
            return copied(params)
        if jax.process_count() == 1:
            return jax.device_put(params, jax.tree.map(lambda x: NamedSharding(self.mesh, x.sharding.spec), params))
        return self._across_processes(params)

    def _across_processes(self, params: Any) -> Any:
        """Several processes: the weights gathered whole on the learner's devices (one program over its mesh; JAX
        moves arrays between device sets of several hosts only on TPU), then each process copies its replica to its
        own sampler devices, device to device: the sampler's weights are whole on each of its devices."""
        leaves = jax.tree.leaves(params)
        if not leaves:  # no frozen weights (full fine-tuning)
            return params
        learner = leaves[0].sharding.mesh
        whole = jax.jit(lambda t: t, out_shardings=sharding.replicated(learner))(params)
        target = NamedSharding(self.mesh, P())
        mine = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

        def move(x: jax.Array) -> jax.Array:
            local = x.addressable_shards[0].data
            return jax.make_array_from_single_device_arrays(x.shape, target, [jax.device_put(local, d) for d in mine])

        return jax.tree.map(move, whole)

    def _placed_frozen(self, frozen: Frozen) -> Frozen:
        """The frozen model weights (a LoRA base) on the sampler's devices, copied there once."""
        if self.mesh is None:
            return frozen
        if self._frozen is None or self._frozen[0] is not frozen.model:
            self._frozen = (frozen.model, Frozen(self.place(frozen.model)))
        return self._frozen[1]

    def fill(self, start: int, params: Any, frozen: Frozen, behind: tuple[list[int], list[Any]] = ([], [])) -> str:
        """Samples the rollouts of steps ``start`` + 1 .. ``start`` + k (up to ``total``): from the trained params
        each was sampled with before (``behind``, a checkpoint's), else from ``params`` (the starting weights, or a
        resumed step's where its checkpoint holds none). The run log's line."""
        self.pending = deque()
        saved = dict(zip(*behind))
        now = None
        steps = range(start + 1, min(start + self.k, self.total) + 1)
        for s in steps:
            if s in saved:
                self._sample(s, max(0, s - 1 - self.k), self.place(saved[s]), frozen)
            else:
                now = self.place(params) if now is None else now
                self._sample(s, start, now, frozen)
        if not steps:
            return ""
        missing = [s for s in steps if s not in saved]
        line = f"objective.max_staleness={self.k}: sampled the rollouts of steps {steps[0]}-{steps[-1]} ahead"
        if start and missing:
            line += (f"; steps {missing[0]}-{missing[-1]} with step {start}'s weights (the checkpoint holds no "
                     "older ones for them)")
        return line

    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s batch and rollout metrics, with its ``staleness``."""
        p = self.pending.popleft()
        if p.step != step:
            raise RuntimeError(f"rollouts sampled ahead out of order: step {step} met the rollout of step {p.step}")
        return p.batch, {**p.sampled, "staleness": float(step - 1 - p.version)}

    def advance(self, step: int, params: Any, frozen: Frozen, train: Callable[[], Any]) -> Any:
        """Train step ``step`` (``train()``, which donates ``params``, the weights of update ``step`` - 1) and, beside
        it, sample the rollout of step ``step`` + k with a copy of those weights; ``train()``'s result.

        On devices shared with the learner the rollout's completions are generated first and the step is dispatched
        as soon as they are on the host, so the host scores them (rewards, tools' rewards, the layout) while the step
        runs. (Dispatching the step first leaves the devices idle while the host scores: with a reward that waits
        0.1 s a batch, measured 0.35-0.40 s a step against 0.28-0.31 on CPU.) On the sampler's own devices
        (``mesh.rollout``) the step is dispatched first and the whole rollout runs beside it. Across CPU processes
        nothing runs beside anything: their collectives (gloo's) mix up the messages of two programs running at once
        on different devices, so the step is waited for where it is dispatched (the order is the shared devices')."""
        held = self.place(params)  # before the step donates them
        if step + self.k > self.total:
            return train()
        serial = jax.process_count() > 1 and jax.devices()[0].platform == "cpu"
        if self.mesh is not None and not serial:
            out = train()
            self._sample(step + self.k, step - 1, held, frozen)
            return out
        out: list[Any] = []
        run = (lambda: out.append(jax.block_until_ready(train()))) if serial else (lambda: out.append(train()))
        self._sample(step + self.k, step - 1, held, frozen, between=run)
        return out[0]

    def position(self) -> dict[str, Any]:
        """The data position a checkpoint saves: before the prompts of the first rollout not yet trained on."""
        return self.pending[0].position if self.pending else self.data.train_iter.get_state()

    def behind(self) -> tuple[list[int], list[Any]]:
        """What a checkpoint saves to sample the pending rollouts again: their steps and trained params."""
        return [p.step for p in self.pending], [p.params for p in self.pending]

    def _sample(self, step: int, version: int, params: Any, frozen: Frozen,
                between: Callable[[], None] | None = None) -> None:
        it = self.data.train_iter
        position = it.get_state()
        if between is not None and self.mesh is not None:  # the step traces under the learner's mesh
            learner, step_now = sharding.active_mesh(), between
            between = lambda: _under(learner, step_now)
        with sharding.use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            batch, sampled = self.rollout.batch(self.weights(params, self._placed_frozen(frozen)),
                                                self.data.prompts.train, next(it), step - 1, more=lambda: next(it),
                                                between=between)
        self.pending.append(Pending(step, version, params, position, batch, sampled))


def _under(mesh: Mesh | None, work: Callable[[], None]) -> None:
    """``work()`` with ``mesh`` the active mesh again (None: none set)."""
    with sharding.use_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        work()
