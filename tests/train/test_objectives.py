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
from jaxtune.train.metrics import StepLog
from jaxtune.train.objectives import CrossEntropy
from jaxtune.train.reference import Frozen
from jaxtune.train.shapes import Shape
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


@dataclass(frozen=True)
class CrossEntropyOfPicked(CrossEntropyWithAccuracy):
    """Cross-entropy with a metric over rows of its own: the mean token loss of the rows the batch's ``picked`` (B,)
    marks, a (sum, count) pair counting those rows (as KTO's rewards count the rows of one label)."""

    name: str = "ce_picked"
    metric_names: tuple[str, ...] = ("picked/loss",)

    def __call__(self, forward, weights, batch, key, reference=None):
        logits = forward.logits(weights, batch, key)
        mask = batch["loss_mask"]
        per_row = jnp.sum(-token_logps(logits, batch["targets"]) * mask, axis=-1) / jnp.maximum(mask.sum(-1), 1.0)
        picked = batch["picked"]
        return jnp.sum(per_row * mask.sum(-1)), jnp.sum(mask), {"picked/loss": (jnp.sum(per_row * picked),
                                                                                  jnp.sum(picked))}


@dataclass(frozen=True)
class CrossEntropyOfBatchMean(CrossEntropyWithAccuracy):
    """Cross-entropy that ``prepares`` a whole-batch statistic first (as KTO's KL baseline is): the batch's mean
    counted tokens per row, reported as ``prepared`` (0 where the batch was not prepared, as KTO falls back to
    z = 0)."""

    name: str = "ce_prepared"
    metric_names: tuple[str, ...] = ("prepared",)
    prepares: bool = True

    def prepare(self, forward, weights, batch, reference=None):
        mean = jnp.mean(jnp.sum(batch["loss_mask"], -1))
        return {**batch, "batch_mean": jnp.broadcast_to(mean, batch["loss_mask"].shape[:1])}

    def __call__(self, forward, weights, batch, key, reference=None):
        total, count, _ = super().__call__(forward, weights, batch, key, reference)
        mean = batch.get("batch_mean", jnp.zeros(batch["loss_mask"].shape[:1]))
        return total, count, {"prepared": (jnp.sum(mean), jnp.asarray(mean.shape[0], jnp.float32))}


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


def test_evaluation_prepares_the_batch_as_training_does():
    """An objective that ``prepares`` (KTO's KL baseline from the batch's mismatched rows) is prepared in the eval step
    too: held-out KTO ran without a baseline and logged kl 0 while training's was 8.3."""
    over = ["model.preset=tiny", "model.max_seq_len=32", "optim.lr=1e-9"]
    spec = make_state_spec(load_config(None, over), V, make_mesh(1, 1, 1, jax.devices()[:1]))
    init = jax.device_get(spec.init(0))
    batch = _batch(8)
    want = float(batch["loss_mask"].sum(-1).mean())
    steps = jit_steps(spec, CrossEntropyOfBatchMean(), load_config(None, over).train)
    with sharding.use_mesh(spec.mesh):
        _, m = steps.train(jax.device_put(init, spec.shardings), sharding.global_batch(spec.mesh, batch), Frozen())
        held_out = steps.evaluate(jax.device_put(init.params, spec.shardings.params), Frozen(), [batch])
    assert float(m["prepared"]) == want and held_out.metrics["prepared"] == want


def test_a_metric_over_rows_of_its_own_is_absent_where_there_are_none(tmp_path):
    """A metric with units of its own (here: rows a batch marks; KTO's rewards of one label) is their mean, weighted
    by how many each part had: over micro-batches (the rows marked all in one of 4), over held-out batches (one
    without any adds nothing: not a 0 halving the mean) and over a logging window (steps weighted by their rows,
    none: absent). Where no unit counts, the step reports NaN with a count of 0, and the evaluation and the logged
    row leave it out; never 0."""
    over = ["model.preset=tiny", "model.max_seq_len=32", "optim.lr=1e-9"]
    spec = make_state_spec(load_config(None, over), V, make_mesh(1, 1, 1, jax.devices()[:1]))
    init = jax.device_get(spec.init(0))
    params = jax.device_put(init.params, spec.shardings.params)
    marked, unmarked = _batch(8), _batch(8)
    marked["picked"] = np.array([1, 0, 0, 0, 1, 0, 0, 0], np.float32)  # rows 0 and 4: micro-batch 0 of 4
    unmarked["picked"] = np.zeros(8, np.float32)
    forward = spec.forward()
    logits = np.asarray(forward.logits(params, {k: jnp.asarray(v) for k, v in marked.items()}))
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), marked["targets"][..., None], -1)[..., 0]
    rows = (nll * marked["loss_mask"]).sum(-1) / marked["loss_mask"].sum(-1)
    want = float(rows[[0, 4]].mean())
    steps = jit_steps(spec, CrossEntropyOfPicked(), load_config(None, [*over, "train.micro_batches=4"]).train)
    with sharding.use_mesh(spec.mesh):
        _, m = steps.train(jax.device_put(init, spec.shardings), sharding.global_batch(spec.mesh, marked), Frozen())
        _, none = steps.train(jax.device_put(init, spec.shardings), sharding.global_batch(spec.mesh, unmarked),
                              Frozen())
        both = steps.evaluate(params, Frozen(), [marked, unmarked])
        without = steps.evaluate(params, Frozen(), [unmarked])
    m, none = jax.device_get((m, none))
    assert abs(float(m["picked/loss"]) - want) <= 1e-5 * want and float(m["picked/loss/count"]) == 2.0
    assert np.isnan(none["picked/loss"]) and float(none["picked/loss/count"]) == 0.0
    assert abs(both.metrics["picked/loss"] - want) <= 1e-5 * want and "picked/loss" not in without.metrics
    assert not any(k.endswith("/count") for k in both.metrics)

    cfg = load_config(None, [*over, "logging.every=3", "logging.jsonl=true", "logging.progress=false",
                             "logging.tensorboard=false", f"run_dir={tmp_path}", "train.steps=6"])
    log = StepLog(tmp_path, cfg, 0, spec.model_cfg)
    base = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "count": 8.0, "finite": True, "nan_streak": 0,
            "rewards/chosen": 1.0, "rewards/chosen/count": 4.0}
    empty = (float("nan"), 0.0)  # a step without undesirable rows
    window = [(2.0, 1.0), empty, (5.0, 3.0), empty, empty, empty]
    for step, (value, count) in enumerate(window, 1):
        log.push(step, {**base, "rewards/rejected": value, "rewards/rejected/count": count}, Shape(32, 256, 256))
    log.drain()
    log.close()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [3, 6]
    assert logged[0]["rewards/rejected"] == (2.0 * 1 + 5.0 * 3) / 4  # weighted by rows, the empty step left out
    assert logged[0]["rewards/margins"] == 1.0 - logged[0]["rewards/rejected"]
    assert "rewards/rejected" not in logged[1] and "rewards/margins" not in logged[1], logged[1]
    assert logged[1]["rewards/chosen"] == 1.0 and not any(k.endswith("/count") for r in logged for k in r)


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
