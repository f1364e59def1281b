"""Exact step 0: before the policy has moved, the reference's log-probs are bitwise the policy's, so every reward is
exactly 0 and no pair counts as won (TRL counts chosen > rejected strictly), at a real model's layer shapes
(SmolLM2-135M: d 576, 9 heads over 3 KV heads, vocabulary 49152; two layers), for LoRA (the reference is the
policy's own program with its adapters zeroed) and for full fine-tuning (a frozen copy); at evaluation, and in the
first train step, whose log-probs come out of a differentiated program (`jaxtune.train.objectives.base.pinned`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers.rows import random_pairs

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.train.objectives import make_objective
from jaxtune.train.reference import FrozenCopy, step_reference
from jaxtune.train.step import jit_steps

B, T, V = 8, 128, 49152
SMOLLM2_LAYERS = ["model.family=llama", "model.n_layer=2", "model.d_model=576", "model.n_head=9",
                  "model.n_kv_head=3", "model.d_ff=1536", f"model.vocab_size={V}", f"model.max_seq_len={T}"]


def _pairs(seed: int = 0) -> dict[str, np.ndarray]:
    """B random pairs laid out as the pipeline does, (B, 2, T): a prompt of 40-70 tokens, completions of 10-40."""
    return random_pairs(B, T, V, (40, 70), (10, 40), seed)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-copy"])
def test_step_zero_rewards_are_exactly_zero(lora):
    cfg = load_config(None, [*SMOLLM2_LAYERS, "objective.name=dpo", "data.format=preference", f"data.seq_len={T}",
                             f"train.batch_size={B}", *(["model.lora.rank=8"] if lora else [])])
    mesh = sharding.make_mesh(1, 1, 1, jax.devices()[:1])
    spec = make_state_spec(cfg, V, mesh)
    reference = step_reference(spec, cfg.objective)
    assert isinstance(reference, FrozenCopy) is not lora
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train, reference)
    state = spec.init(0)
    frozen = steps.frozen(spec.load_frozen(0), 0)
    with sharding.use_mesh(mesh):
        result = steps.evaluate(state.params, frozen, [_pairs()])
    m = result.metrics
    assert m["logps/chosen"] < -100  # real sums, not empty rows
    assert m["rewards/chosen"] == m["rewards/rejected"] == m["rewards/margins"] == 0.0, m
    assert m["rewards/accuracies"] == 0.0
    assert abs(result.loss - np.log(2)) < 1e-6
    # The first train step sees the same pairs before its update: exactly 0 again. The second sees moved weights:
    # its rewards are real differences (the pinning is not a constant).
    with sharding.use_mesh(mesh):
        batch = sharding.global_batch(mesh, _pairs())
        state, first = steps.train(state, batch, frozen)
        _, second = steps.train(state, batch, frozen)
    first, second = jax.device_get((first, second))
    assert first["rewards/margins"] == first["rewards/chosen"] == first["rewards/accuracies"] == 0.0, first
    assert abs(float(first["loss"]) - np.log(2)) < 1e-6
    assert abs(float(second["rewards/margins"])) > 1e-4 and float(second["rewards/accuracies"]) > 0, second
