"""TR-DPO's reference sync (``objective.sync_ref_model``, `jaxtune.train.reference.ReferenceSync`).

The mix is alpha x policy + (1 - alpha) x reference, computed on the devices by one program with the reference's
shardings, and agrees with TRL 1.16's `SyncRefModelCallback` on the same weights; the DPO step after a sync measures
its rewards against the mixed reference; a run syncs on its schedule (in optimizer updates), says so in its log,
saves the mixed reference with each checkpoint, and a killed run resumes with it, bitwise. With the sync off a
checkpoint holds what it always held."""

from __future__ import annotations

import itertools
import json

import jax
import numpy as np
import pytest
from helpers.rows import random_pairs, write_jsonl
from helpers.run_outputs import final_params, metric_rows
from helpers.tiny_runs import assert_kill9_resume_is_bitwise, run_overrides

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.cli import main
from jaxtune.config import ConfigError, load_config
from jaxtune.data import load_tokenizer_dir
from jaxtune.data.synthetic import arithmetic_preferences
from jaxtune.job.checkpoint import REFERENCE, Checkpointer
from jaxtune.loop import train
from jaxtune.train.objectives.preference import flat_pairs, pair_logps
from jaxtune.train.reference import ReferenceSync, mixed, reference_sync
from jaxtune.train.step import run_steps

V, T, B = 64, 32, 4
ALPHA = 0.6  # TRL 1.16's ref_model_mixup_alpha
UNIT = ["model.family=llama", "model.preset=tiny", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "model.n_kv_head=1", "model.d_ff=64", f"model.vocab_size={V}", f"model.max_seq_len={T}", "objective.name=dpo",
        "data.format=preference", f"data.seq_len={T}", f"train.batch_size={B}", "optim.lr=1e-2",
        "objective.sync_ref_model=true", "objective.ref_model_sync_steps=1"]
# A tiny DPO run (the old-runs fixture's one-layer model) on generated arithmetic pairs, syncing every 2 steps.
RUN = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.n_kv_head=1", "model.d_ff=64",
       "data.format=preference", "data.chat_template=chatml", "data.seq_len=64", "data.val_fraction=0.1",
       "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
       "objective.name=dpo", "optim.lr=1e-2", "optim.warmup_steps=2", "train.batch_size=8", "eval.every=0",
       "logging.every=1", "logging.progress=false", "logging.tensorboard=false", "eval.exact_match=0",
       "eval.prompts=[]", "objective.sync_ref_model=true", "objective.ref_model_sync_steps=2", "checkpoint.keep=10"]

# GRPO with a KL to the reference (the old-runs fixture's), two updates a step, syncing every 4 updates.
GRPO = ["model.family=llama", "model.preset=tiny", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
        "model.n_kv_head=1", "model.d_ff=64", "model.max_seq_len=64", "tokenizer.kind=bpe",
        "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]", "data.chat_template=chatml",
        "data.sources=[synthetic:arithmetic-prompts]", "data.format=prompts", "data.seq_len=48",
        "data.val_fraction=0.1", "objective.name=grpo", "objective.beta=0.04", "objective.num_generations=4",
        "objective.max_completion_length=16", "objective.rewards=[{name: exact_number, field: answer}]",
        "objective.prompts_per_step=4", "optim.lr=1e-2", "objective.num_iterations=2", "objective.sync_ref_model=true",
        "objective.ref_model_sync_steps=4",
        "train.steps=2", "checkpoint.every=1", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
        "eval.exact_match=0", "eval.prompts=[]"]


def _unit():
    """(spec, steps, sync, mesh) of a tiny DPO model syncing every step, on one device."""
    cfg = load_config(None, UNIT)
    mesh = sharding.make_mesh(1, 1, 1, jax.devices()[:1])
    spec = make_state_spec(cfg, V, mesh)
    steps = run_steps(spec, cfg)
    return spec, steps, reference_sync(cfg.objective, steps.companion), mesh


def _host(tree):
    """``tree`` copied to numpy (a view of a CPU buffer would keep it from being donated)."""
    return jax.tree.map(np.array, tree)


def _pairs(seed: int = 0) -> dict[str, np.ndarray]:
    """B random pairs, (B, 2, T): a prompt of 8-11 tokens, completions of 4-9."""
    return random_pairs(B, T, V, (8, 12), (4, 10), seed)


def _assert_mix(got, policy, reference, alpha: float = ALPHA) -> None:
    """``got`` is alpha x policy + (1 - alpha) x reference, weight by weight, to float32 rounding (1e-6)."""
    expected = jax.tree.map(lambda p, r: alpha * p.astype(np.float64) + (1 - alpha) * r.astype(np.float64),
                            policy, reference)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6), _host(got), expected)


def test_the_mix_runs_on_the_devices_in_one_program_with_the_references_shardings():
    spec, steps, sync, mesh = _unit()
    frozen = steps.frozen((), 0)
    rng = np.random.default_rng(1)
    with sharding.use_mesh(mesh):
        for _ in range(3):
            params = jax.tree.map(lambda a: jax.device_put(rng.normal(size=a.shape).astype(a.dtype), a.sharding),
                                  spec.abstract.params)
            before, old = _host(frozen.companion), frozen.companion
            with jax.transfer_guard("disallow"):  # no host round trip
                frozen = sync(frozen, params)
            _assert_mix(frozen.companion, _host(params), before)
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))  # donated: one copy held at a time
            placed = jax.tree.map(lambda a, s: a.sharding == s, frozen.companion, steps.companion.shardings)
            assert all(jax.tree.leaves(placed))
    assert sync.compiles == 1


def test_the_mix_is_trls_callback_arithmetic_on_the_same_weights():
    """TRL 1.16's `SyncRefModelCallback._sync_target_model` (in place: ref x (1 - alpha) + alpha x policy) on torch
    copies of the tiny model's weights, three syncs of a moving policy, at TRL's alpha and another."""
    torch = pytest.importorskip("torch")
    callbacks = pytest.importorskip("trl.trainer.callbacks")
    spec, _, _, _ = _unit()
    reference = _host(spec.init(0).params)
    rng = np.random.default_rng(2)
    for alpha in (ALPHA, 0.25):
        ours, ref_torch = reference, torch.nn.ParameterList([torch.tensor(x) for x in jax.tree.leaves(reference)])
        for _ in range(3):
            policy = jax.tree.map(lambda x: (x + rng.normal(scale=0.1, size=x.shape)).astype(x.dtype), reference)
            policy_torch = torch.nn.ParameterList([torch.tensor(x) for x in jax.tree.leaves(policy)])
            callbacks.SyncRefModelCallback._sync_target_model(policy_torch, ref_torch, alpha)
            ours = _host(jax.jit(mixed, static_argnums=0)(alpha, ours, policy))
            for mine, theirs in zip(jax.tree.leaves(ours), ref_torch, strict=True):
                np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_the_dpo_step_after_a_sync_measures_its_rewards_against_the_mixed_reference():
    spec, steps, sync, mesh = _unit()
    state, frozen = spec.init(0), steps.frozen((), 0)
    initial = _host(frozen.companion)
    forward = spec.forward(0)
    with sharding.use_mesh(mesh):
        batch = sharding.global_batch(mesh, _pairs())
        logps = lambda weights: np.asarray(pair_logps(forward.token_logps(weights, flat_pairs(batch), None), batch)[0])
        state, _ = steps.train(state, batch, frozen)
        policy = _host(state.params)
        frozen = sync(frozen, state.params)
        _assert_mix(frozen.companion, policy, initial)
        ours, against_mixed, against_initial = logps(state.params), logps(frozen.companion), logps(initial)
        _, metrics = steps.train(state, batch, frozen)
    beta = 0.1
    for side, name in enumerate(("rewards/chosen", "rewards/rejected")):
        got = float(metrics[name])
        assert got == pytest.approx(np.mean(beta * (ours[:, side] - against_mixed[:, side])), rel=1e-5, abs=1e-7)
        assert got != pytest.approx(np.mean(beta * (ours[:, side] - against_initial[:, side])), rel=1e-3)


def test_syncs_are_counted_in_optimizer_updates_and_off_by_default():
    """TRL syncs after every ``ref_model_sync_steps``-th optimizer update: a GRPO step of num_iterations=2 holds two,
    so every 3 updates is after steps 2, 3, 5, 6. With the key off there is no sync."""
    sync = ReferenceSync(ALPHA, every=3, passes=2, mix=lambda r, p: r, abstract=None)
    assert [s for s in range(1, 7) if sync.due(s)] == [2, 3, 5, 6]
    assert [s for s in range(1, 7) if ReferenceSync(ALPHA, 2, 1, lambda r, p: r, None).due(s)] == [2, 4, 6]
    cfg = load_config(None, [*UNIT, "objective.sync_ref_model=false"])
    assert reference_sync(cfg.objective, None) is None


def test_a_checkpoint_holds_a_reference_only_where_one_is_given(tmp_path):
    """Without a synced reference a step is the three items it always was; restoring a reference from it is one
    line naming the step."""
    cfg = load_config(None, UNIT)
    ckpt = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint)
    weights = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    ckpt.save(1, weights, {"pos": 1}, {"c": 1})
    ckpt.save(2, weights, {"pos": 2}, {"c": 1}, reference={"w": np.ones((2, 3), np.float32)})
    ckpt.wait()
    assert not (tmp_path / "checkpoints" / "1" / REFERENCE).exists()
    abstract = {"w": jax.ShapeDtypeStruct((2, 3), np.float32)}
    np.testing.assert_array_equal(ckpt.restore_reference(2, abstract)["w"], np.ones((2, 3), np.float32))
    with pytest.raises(ConfigError, match=r"^checkpoint step 1 in .* holds no reference model, which "
                                          r"objective.sync_ref_model=true resumes with; use another run_dir"):
        ckpt.restore_reference(1, abstract)
    ckpt.close()


@pytest.fixture
def pref(tmp_path, data_cache):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", itertools.islice(arithmetic_preferences(), 240))
    return run_overrides(RUN, pairs, tmp_path, data_cache)


def _reference(cfg, step: int):
    """(the reference model checkpoint ``step`` of ``cfg``'s run holds, as numpy arrays; the run's spec)."""
    vocab = load_tokenizer_dir(cfg.run_path / "tokenizer").vocab_size
    spec = make_state_spec(cfg, vocab, sharding.make_mesh(1, 1, 1, jax.devices()[:1]))
    ckpt = Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint)
    reference = _host(ckpt.restore_reference(step, spec.abstract.params))
    ckpt.close()
    return reference, spec


def test_a_dpo_run_syncs_on_schedule_says_so_and_saves_the_mixed_reference(pref, capsys):
    """Synced after steps 2 and 4, before their checkpoints; `jaxtune eval` of the run scores against the reference
    its checkpoint holds, as the run's own last evaluation did."""
    cfg = load_config(None, pref("train.steps=4", "checkpoint.every=1", "eval.every=4", "eval.batches=2"))
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths)
    out = capsys.readouterr().out
    synced = [line for line in out.splitlines() if "ref_sync" in line]
    assert synced == [f"step {s}: ref_sync: reference = 0.6 x policy + 0.4 x reference (objective.sync_ref_model, "
                      "every 2 updates)" for s in (2, 4)], out
    first, spec = _reference(cfg, 1)
    jax.tree.map(np.testing.assert_array_equal, first, _host(spec.init(cfg.train.seed).params))  # not synced yet
    second, _ = _reference(cfg, 2)
    _assert_mix(second, final_params(cfg, 2)[0], first)
    third, _ = _reference(cfg, 3)
    jax.tree.map(np.testing.assert_array_equal, third, second)
    fourth, _ = _reference(cfg, 4)
    _assert_mix(fourth, final_params(cfg, 4)[0], third)
    assert main(["eval", str(cfg.run_path)]) == 0
    held_out, last = json.loads(capsys.readouterr().out), metric_rows(cfg.run_path, "eval")[-1]
    assert last["step"] == 4
    for key in ("loss", "rewards/chosen", "rewards/margins"):
        assert held_out[key] == pytest.approx(last[key], rel=1e-6, abs=1e-9), key


def test_a_killed_dpo_run_with_sync_resumes_with_the_mixed_reference_bitwise(pref, tmp_path):
    """Sync every 2 steps, killed at step 5 with step 3 committed (its reference synced at step 2): the resumed run
    reads that reference, not the initial copy, so its losses, final weights and final reference are the
    uninterrupted run's bitwise."""
    over = ["train.steps=6", "checkpoint.every=3"]
    assert_kill9_resume_is_bitwise(tmp_path, pref, over, steps=6, kill_at=5, commit=3)
    killed, uninterrupted = [_reference(load_config(None, pref(*over, run=run)), 6)[0] for run in ("killed", "ref")]
    jax.tree.map(np.testing.assert_array_equal, killed, uninterrupted)


def test_a_grpo_run_with_a_kl_syncs_after_the_update_that_reaches_the_interval(tmp_path, data_cache, capsys):
    """GRPO with beta > 0 and num_iterations=2: every 4 updates is after step 2, not step 1 (TRL counts updates)."""
    cfg = load_config(None, [*GRPO, f"data.cache_dir={data_cache}", f"run_dir={tmp_path / 'run'}"])
    train(cfg)
    synced = [line for line in capsys.readouterr().out.splitlines() if "ref_sync" in line]
    assert synced == [("step 2: ref_sync: reference = 0.6 x policy + 0.4 x reference (objective.sync_ref_model, "
                       "every 4 updates)")]
    first, spec = _reference(cfg, 1)
    jax.tree.map(np.testing.assert_array_equal, first, _host(spec.init(cfg.train.seed).params))
    _assert_mix(_reference(cfg, 2)[0], final_params(cfg, 2)[0], first)
