"""Shared prompts (issue 30): a preference pair laid out as one row, its prompt once and then both completions
(`jaxtune.data.preference.shared_row`, the branch mask of `jaxtune.models.layers.attention_mask`), gives the
log-probs and gradients of the two separate rows, for every native family (GPT-2's learned positions; Llama's RoPE
with grouped-query attention and LoRA; Gemma 3's sliding window of 16 positions, shorter than the pairs, measured in
positions rather than slots), and trains as the separate rows do in a real run.

Error measure: rel(ours, ref) = max|ours - ref| / max|ref|, float32 on both sides. Tolerances: log-probs 1e-5
(the same products summed in another order: measured ~1e-7), gradients 1e-4 (measured ~1e-6).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compare import rel

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import ConfigError, load_config
from jaxtune.data.encoded import Encoded
from jaxtune.data.preference import PairRows
from jaxtune.loop import rows_per_device, train
from jaxtune.rollout.rollout import shared_rows, training_rows
from jaxtune.train.objectives import GRPO
from jaxtune.train.objectives.base import Reference
from jaxtune.train.objectives.preference import flat_pairs, pair_logps
from jaxtune.train.shapes import BatchShapes

T, V = 64, 512
FAMILIES = {
    "gpt2": ["model.family=gpt2", "model.n_layer=2", "model.d_model=64", "model.n_head=4", f"model.vocab_size={V}",
             "model.max_seq_len=64"],
    "llama-lora": ["model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64",
                   "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128", f"model.vocab_size={V}",
                   "model.max_seq_len=64", "model.lora.rank=4"],
    "gemma3-window16": ["model.family=gemma3", "model.preset=tiny", f"model.vocab_size={V}", "model.max_seq_len=64"],
}


def _pairs(n: int = 6, seed: int = 0) -> list[tuple[Encoded, Encoded]]:
    """Pairs like chat preference data: a prompt of 20-40 tokens, completions of 3-23 (one of them the longest that
    fits T + 1 tokens), no loss on the prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(1, V, rng.integers(20, 40))
        sides = []
        for _ in range(2):
            k = T + 1 - len(prompt) if i == 0 else int(rng.integers(3, 24))
            ids = np.concatenate([prompt, rng.integers(1, V, k)]).astype(np.int32)
            sides.append(Encoded(ids, np.arange(len(ids)) >= len(prompt)))
        out.append(tuple(sides))
    return out


def _batch(rows: PairRows) -> dict[str, jax.Array]:
    items = [rows[i] for i in range(len(rows))]
    return {k: jnp.asarray(np.stack([it[k] for it in items])) for k in items[0]}


def _spec(name: str):
    cfg = load_config(None, [*FAMILIES[name], "objective.name=simpo", "data.format=preference",
                             f"data.seq_len={T}", "train.batch_size=6"])
    return make_state_spec(cfg, V, sharding.make_mesh(1, 1, 1, jax.devices()[:1]))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_shared_prompt_rows_give_the_separate_rows_logps_and_gradients(name):
    spec = _spec(name)
    forward, frozen = spec.forward(), spec.load_frozen(0)
    params = spec.init(0).params
    rng = np.random.default_rng(1)  # LoRA's B is 0 at init: move every trained weight so the adapters count
    params = jax.tree.map(lambda x: x + jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype), params)
    pairs = _pairs()
    plain, shared = _batch(PairRows.of(pairs, T)), _batch(PairRows.of(pairs, T, shared=True))
    assert plain["inputs"].shape == (6, 2, T) and shared["inputs"].shape == (6, 2 * T)
    assert int(jnp.sum(shared["segment_ids"] > 0)) < int(jnp.sum(plain["segment_ids"] > 0))  # the prompt once

    def logps(p, batch):
        return pair_logps(forward.token_logps(spec.weights(p, frozen), flat_pairs(batch)), batch)

    def margin(p, batch):  # a scalar that depends on both completions of every pair
        summed, counts = logps(p, batch)
        return jnp.sum(summed[:, 0] / counts[:, 0] - 0.7 * summed[:, 1] / counts[:, 1])

    (a, na), (b, nb) = jax.jit(logps)(params, plain), jax.jit(logps)(params, shared)
    assert np.array_equal(na, nb) and float(jnp.min(na)) >= 3
    assert rel(b, a) <= 1e-5, rel(b, a)
    ga, gb = jax.jit(jax.grad(margin))(params, plain), jax.jit(jax.grad(margin))(params, shared)
    for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(ga), strict=True):
        assert rel(x, y) <= 1e-4, rel(x, y)


def _run(tmp_path, name, *extra):
    cfg = load_config(None, [
        *FAMILIES["llama-lora"][:-3], "model.max_seq_len=128", "objective.name=dpo", "data.format=preference",
        "data.sources=[synthetic:arithmetic-preferences]", "data.chat_template=chatml", "data.seq_len=128",
        "data.val_fraction=0.01", f"data.cache_dir={tmp_path}/cache", "tokenizer.kind=bpe",
        "tokenizer.vocab_size=300", "tokenizer.train_bytes=100000",
        "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
        "train.steps=3", "train.batch_size=4", "checkpoint.every=3", "eval.every=3", "eval.batches=1",
        "logging.every=1", "logging.progress=false", "logging.tensorboard=false", "train.compile_cache_dir=null",
        f"run_dir={tmp_path / name}", *extra])
    result = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def test_dpo_with_shared_prompts_trains_as_separate_rows(tmp_path):
    """A DPO run (LoRA, held-out evaluation at step 0 and 3) with shared prompts, the default, against the same run
    with a row per completion: the same losses and rewards to float rounding, fewer positions computed, one train
    program per bucket met."""
    shared, shared_rows = _run(tmp_path, "shared")
    plain, plain_rows = _run(tmp_path, "plain", "data.share_prompts=false")
    assert shared.step_compiles == len(shared.step_lengths) and plain.step_compiles == len(plain.step_lengths)
    assert len(shared_rows) == len(plain_rows) >= 5
    for a, b in zip(shared_rows, plain_rows, strict=True):
        assert a["kind"] == b["kind"]
        loss = "step_loss" if a["kind"] == "train" else "loss"
        assert abs(a[loss] - b[loss]) <= 1e-5 * abs(b[loss]), (a, b)
        assert abs(a["rewards/margins"] - b["rewards/margins"]) <= 1e-4 * max(abs(b["rewards/margins"]), 1e-3)
        if a["kind"] == "train":
            assert a["tokens"] < b["tokens"]  # positions computed: the prompt once per pair, not twice


def test_shared_prompts_follow_the_backend():
    base = ["objective.name=dpo", "data.format=preference"]
    assert load_config(None, base).data.shares_prompts
    assert not load_config(None, [*base, "data.share_prompts=false"]).data.shares_prompts
    assert not load_config(None, ["data.format=messages"]).data.shares_prompts  # rows have no shared prompt
    hf = ["model.backend=torchax", "model.hf_config=some/dir"]
    assert not load_config(None, [*base, *hf]).data.shares_prompts  # HuggingFace's attention takes no branches
    with pytest.raises(ConfigError, match="data.share_prompts=true needs a native model"):
        load_config(None, [*base, *hf, "data.share_prompts=true"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_grpo_groups_in_regions_give_the_separate_rows_logps_and_gradients(name):
    """A prompt's G completions in regions (`shared_rows`: the prompt's 32 slots, then each completion's 32 of its
    own, attention per region, `RegionMask`) against a row per completion: the same log-probs and gradients for every
    family (Gemma 3's window of 16 positions is shorter than the rows), as laid out and as `BatchShapes.fit` cuts
    them: the prompt's slots to the bucket of its longest (24 of 32), and each completion's to the bucket of the
    longest completion (all 32 when one fills them; 16 when none is longer than 10)."""
    spec = _spec(name)
    forward, frozen = spec.forward(), spec.load_frozen(0)
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda x: x + jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype), spec.init(0).params)
    g, width, prompts = 3, 32, [rng.integers(1, V, n).tolist() for n in (1, 12, 25)]
    prompt_ids = [p for p in prompts for _ in range(g)]
    keys = ("inputs", "targets", "positions", "segment_ids", "loss_mask", "branch_ids", "sampler_logps")
    shapes = BatchShapes(T - width + g * width, 4, keys, regions=(T - width, g, width))
    rows = lambda batch: {k: batch[k] for k in ("inputs", "targets", "positions", "segment_ids", "branch_ids",
                                                "branch_slots") if k in batch}

    def per_completion(p, batch):  # (completions,) log-prob sums: each row's, or each region's
        lp = forward.token_logps(spec.weights(p, frozen), rows(batch)) * batch["loss_mask"]
        if "branch_ids" not in batch:
            return jnp.sum(lp, -1)
        of = batch["branch_ids"][:, None, :] == jnp.arange(1, g + 1)[None, :, None]
        return jnp.sum(lp[:, None, :] * of, -1).reshape(-1)

    weight = jnp.asarray(rng.standard_normal(len(prompt_ids)), jnp.float32)
    objective = lambda p, batch: jnp.sum(per_completion(p, batch) * weight)
    on_device = lambda batch: {k: jnp.asarray(v) for k, v in batch.items()}
    for longest, completion_slots in ((width, width), (10, 16)):
        completions = [rng.integers(1, V, longest if i == 8 else rng.integers(1, longest)).tolist()
                       for i in range(len(prompt_ids))]
        zeros = [[0.0] * len(c) for c in completions]
        plain = on_device(training_rows(prompt_ids, completions, zeros, T))
        regions = shared_rows(prompt_ids, completions, zeros, g, T, width)
        cut, shape = shapes.fit(regions)
        assert shape.regions == (24, completion_slots) and shape.length == 24 + g * completion_slots
        assert cut["inputs"].shape == (3, shape.length) and cut["branch_slots"].shape == (3, g, completion_slots)
        a = jax.jit(per_completion)(params, plain)
        for batch in (regions, cut):
            b = jax.jit(per_completion)(params, on_device(batch))
            assert rel(b, a) <= 1e-5, rel(b, a)
        ga, gb = (jax.jit(jax.grad(objective))(params, batch) for batch in (plain, on_device(cut)))
        for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(ga), strict=True):
            assert rel(x, y) <= 1e-4, rel(x, y)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])  # dr_grpo is dapo's sum over another constant
def test_grpo_groups_in_one_row_give_the_separate_rows_loss_and_gradients(loss_type):
    """GRPO's G completions of a prompt as one row (`shared_rows`, advantages (prompts, G)) against a row per
    completion (`training_rows`): the same loss, metrics and gradients, with a KL to a reference (beta 0.04) and old
    log-probs of other weights (ratios away from 1, clipping active), and an importance-sampling correction against
    sampler log-probs (a ratio per completion, truncated, with ``grpo``; per token, masked, with ``dapo``): ``grpo``
    sums per completion (per branch), ``dapo`` over every token."""
    spec = _spec("llama-lora")
    forward, frozen = spec.forward(), spec.load_frozen(0)
    rng = np.random.default_rng(2)
    moved = lambda p, s: jax.tree.map(lambda x: x + jnp.asarray(s * rng.standard_normal(x.shape), x.dtype), p)
    params, old_params = moved(spec.init(0).params, 0.05), moved(spec.init(0).params, 0.05)
    g, prompts = 4, [rng.integers(1, V, rng.integers(10, 30)).tolist() for _ in range(3)]
    prompt_ids = [p for p in prompts for _ in range(g)]
    completions = [rng.integers(1, V, rng.integers(1, 20)).tolist() for _ in prompt_ids]
    adv = rng.standard_normal(len(prompt_ids)).astype(np.float32)
    weights = lambda p: spec.weights(p, frozen)
    # The sampler's log-probs: the old weights' (the trainer's) and noise, so the importance ratios move about 1.
    zeros = [[0.0] * len(c) for c in completions]
    old_rows = np.asarray(forward.token_logps(weights(old_params), training_rows(prompt_ids, completions, zeros, T)))
    sampled = [(old_rows[i, len(p) - 1:len(p) - 1 + len(c)] + 0.1 * rng.standard_normal(len(c))).tolist()
               for i, (p, c) in enumerate(zip(prompt_ids, completions))]
    plain = {**training_rows(prompt_ids, completions, sampled, T), "advantages": adv}
    shared = {**shared_rows(prompt_ids, completions, sampled, g, T, 20), "advantages": adv.reshape(-1, g)}
    assert shared["inputs"].shape == (3, T - 20 + g * 20) and plain["inputs"].shape == (3 * g, T)
    assert shared["branch_slots"].shape == (3, g, 20)
    # grpo: a per-completion (sequence) ratio, summed per branch; dapo: per token
    objective = GRPO(beta=0.04, loss_type=loss_type, max_completion_length=20, passes=2,
                     importance_sampling="sequence_truncate" if loss_type == "grpo" else "token_mask",
                     importance_sampling_min=0.9, importance_sampling_max=1.1)
    reference = Reference(lambda rows, temperature=1.0: forward.token_logps(weights(spec.init(0).params), rows, None,
                                                                            temperature), jnp.bool_(False))

    def loss(p, batch):
        batch = objective.prepare(forward, weights(old_params), {k: jnp.asarray(v) for k, v in batch.items()})
        total, count, metrics = objective(forward, weights(p), batch, None, reference)
        return total / count, {k: v[0] / v[1] if isinstance(v, tuple) else v for k, v in metrics.items()}

    (la, ma), ga = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, plain)
    (lb, mb), gb = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, shared)
    assert abs(float(lb - la)) <= 1e-5 * abs(float(la)), (lb, la)
    assert float(ma["clip_ratio/region_mean"]) > 0 and float(ma["kl"]) > 0
    assert 0 < float(ma["importance_sampling_ratio/mean"]) < 1.1 and float(ma["sampler_logp_diff/max"]) > 0.1
    assert float(ma["importance_sampling_ratio/min"]) <= 0.9 or float(ma["importance_sampling_ratio/max"]) >= 1.1
    for k in ma:
        assert abs(float(mb[k] - ma[k])) <= 1e-5 * max(abs(float(ma[k])), 1e-6), (k, mb[k], ma[k])
    for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(ga), strict=True):
        assert rel(x, y) <= 1e-4, rel(x, y)


def test_grpo_groups_as_rows_need_a_multiple_of_the_data_parallel_devices():
    """One row per prompt splits over the data-parallel devices only in whole prompts: with the key unset the run
    falls back to a row per completion, with it set the error names the key and what to change."""
    base = ["objective.name=grpo", "data.format=prompts", "objective.prompts_per_step=3", "objective.num_generations=4",
            "objective.rewards=[{name: exact_number}]"]
    assert rows_per_device(load_config(None, base), 1).data.shares_prompts == (
        load_config(None, base).data.shares_prompts)
    assert not rows_per_device(load_config(None, base), 2).data.shares_prompts  # 3 prompts over 2 devices: rows
    assert rows_per_device(load_config(None, [*base, "objective.prompts_per_step=4"]), 2).data.shares_prompts == (
        load_config(None, base).data.shares_prompts)
    with pytest.raises(ConfigError,
                       match=r"objective.prompts_per_step=3: .* multiple of 2 .* data.share_prompts=false"):
        rows_per_device(load_config(None, [*base, "data.share_prompts=true"]), 2)


def test_masking_truncated_completions_leaves_out_their_tokens_in_either_layout():
    """``mask_truncated_completions`` (TRL's: a completion whose last token is not an end token has no loss):
    `completion_kept` zeros exactly the cut completions' tokens, in a row per completion and in a row per prompt
    with the completions as branches, and keeps every token of the others."""
    from jaxtune.config.kinds import BRANCH_KEY
    from jaxtune.rollout.rollout import completion_kept

    rng = np.random.default_rng(3)
    g, prompts = 4, [rng.integers(1, V, rng.integers(10, 30)).tolist() for _ in range(3)]
    prompt_ids = [p for p in prompts for _ in range(g)]
    completions = [rng.integers(1, V, rng.integers(1, 20)).tolist() for _ in prompt_ids]
    stopped = rng.random(len(completions)) < 0.5
    stopped[:2] = [True, False]
    zeros = [[0.0] * len(c) for c in completions]
    plain = training_rows(prompt_ids, completions, zeros, T)
    shared = shared_rows(prompt_ids, completions, zeros, g, T, 20)
    kept_plain = plain["loss_mask"] * completion_kept(plain, stopped)
    kept_shared = shared["loss_mask"] * completion_kept(shared, stopped)
    want = [len(c) * s for c, s in zip(completions, stopped)]
    assert kept_plain.sum(axis=1).tolist() == want
    per_branch = [float((kept_shared[i // g] * (shared[BRANCH_KEY][i // g] == i % g + 1)).sum())
                  for i in range(len(completions))]
    assert per_branch == want and sum(want) < sum(len(c) for c in completions)
