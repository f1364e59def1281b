"""Objectives are components: the step is built from (model, objective, optimizer), and whatever scalars an
objective returns are accumulated like the loss and logged at train and eval without touching the step or loop."""

from __future__ import annotations

import json
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune import loop, sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.sharding import make_mesh
from jaxtune.train import step as step_module
from jaxtune.train.logprobs import token_logps
from jaxtune.train.objectives import CrossEntropy
from jaxtune.train.reference import Frozen
from jaxtune.train.step import jit_steps, make_eval_step, objective_loss

V = 512


@dataclass(frozen=True)
class CrossEntropyWithAccuracy:
    """Cross-entropy that also counts the counted tokens the model already predicts (argmax): a metric summed over
    the same units as the loss."""

    name: str = "ce_accuracy"
    metric_names: tuple[str, ...] = ("accuracy",)
    uses_reference: bool = False
    passes: int = 1
    prepares: bool = False

    @classmethod
    def from_config(cls, cfg):
        return cls()

    def prepare(self, forward, weights, batch, reference=None):
        return batch

    def __call__(self, forward, weights, batch, key, reference=None):
        logits = forward.logits(weights, batch, key)
        mask = batch.get("loss_mask", jnp.ones(batch["targets"].shape, jnp.float32))
        right = (jnp.argmax(logits, -1) == batch["targets"]) * mask
        return jnp.sum(-token_logps(logits, batch["targets"]) * mask), jnp.sum(mask), {"accuracy": jnp.sum(right)}


def _batch(rows: int, t: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    toks = rng.randint(0, V, (rows, t + 1)).astype(np.int32)
    lengths = rng.randint(1, t + 1, rows)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:],
            "loss_mask": (np.arange(t)[None] < lengths[:, None]).astype(np.float32)}


def test_objective_metrics_are_per_unit_and_accumulate_over_micro_batches():
    """The step divides an objective's metric sums by the total count, over micro-batches as over one batch; the
    value equals a reference computed from the model's logits; cross-entropy through either objective agrees."""
    batch = _batch(8)
    over = ["model.preset=tiny", "model.max_seq_len=32", "optim.lr=1e-9"]
    # One spec and one initial state for both step builds (micro_batches is the step's, not the spec's): the
    # state goes to the device anew for each step, which donates it.
    spec = make_state_spec(load_config(None, over), V, make_mesh(1, 1, 1, jax.devices()[:1]))
    init = jax.device_get(spec.init(0))
    params = jax.device_put(init.params, spec.shardings.params)
    logits = spec.forward().logits(params, {k: jnp.asarray(v) for k, v in batch.items()})
    out = {}
    for micro in (1, 4):
        cfg = load_config(None, [*over, f"train.micro_batches={micro}"])
        steps = jit_steps(spec, CrossEntropyWithAccuracy(), cfg.train)
        with sharding.use_mesh(spec.mesh):
            _, m = steps.train(jax.device_put(init, spec.shardings), sharding.global_batch(spec.mesh, batch), Frozen())
        out[micro] = {k: float(v) for k, v in m.items()}
    mask = batch["loss_mask"]
    want = float(((np.asarray(logits).argmax(-1) == batch["targets"]) * mask).sum() / mask.sum())
    assert abs(out[1]["accuracy"] - want) <= 1e-6 and abs(out[4]["accuracy"] - want) <= 1e-6
    assert abs(out[1]["loss"] - out[4]["loss"]) <= 1e-5 * out[1]["loss"]
    ce = make_eval_step(objective_loss(CrossEntropy(), spec.forward(), spec.weights))
    s, n, extra = ce(params, {k: jnp.asarray(v) for k, v in batch.items()})
    assert extra == {} and abs(float(s / n) - out[1]["loss"]) <= 1e-6 * out[1]["loss"]


def test_the_loop_logs_every_scalar_an_objective_returns(tiny_cfg, monkeypatch):
    """train() with another objective: its metric is in metrics.jsonl at every train and eval row, with no change
    to the loop."""
    monkeypatch.setattr(step_module, "make_objective", lambda cfg: CrossEntropyWithAccuracy())  # what run_steps calls
    cfg = tiny_cfg("train.steps=4", "eval.every=2", "eval.batches=1", "checkpoint.every=4")
    result = loop.train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    eval_rows = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4] and [r["step"] for r in eval_rows] == [0, 2, 4]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in train_rows + eval_rows)
    assert result.losses[4] == train_rows[-1]["step_loss"]


def test_native_forward_hidden_states_are_what_the_head_reads():
    """GPT-2 ties its head to the token embedding: logits == hidden @ wte.T (rel <= 1e-5)."""
    cfg = load_config(None, ["model.preset=tiny", "model.max_seq_len=32"])
    spec = make_state_spec(cfg, V, make_mesh(1, 1, 1, jax.devices()[:1]))
    params, batch = spec.init(0).params, {k: jnp.asarray(v) for k, v in _batch(2).items()}
    forward = spec.forward()
    hidden, logits = forward.hidden(params, batch), forward.logits(params, batch)
    table = next(x for x in jax.tree.leaves(params) if x.shape == (V, spec.model_cfg.d_model))
    ref = np.asarray(hidden) @ np.asarray(table).T
    assert hidden.shape == (2, 32, spec.model_cfg.d_model)
    assert np.abs(np.asarray(logits) - ref).max() <= 1e-5 * np.abs(ref).max()
