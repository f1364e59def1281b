"""Generation: KV-cache greedy decoding against a naive full-forward loop, EOS, sampling filters, compile buckets."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtune.models.gpt2 import GPT, PRESETS
from jaxtune.models.sampling import Generator, Sampling, bucket, pack_prompts, sample_logits

CFG = PRESETS["tiny"]()  # 128-token context
CTX = CFG.max_seq_len
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 11, 3)]  # one prompt bucket (16)
del _rng
N_NEW = 10


@pytest.fixture(scope="module")
def model(gpt_params):
    """(graphdef, params) of a tiny GPT whose greedy continuations vary.

    At the 0.02 init scale the residual stream is the token embedding, so greedy repeats one token forever and
    a broken cache would go unnoticed; blocks x3 make each step depend on the context.
    """
    graphdef = nnx.split(nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(params=0))), nnx.Param)[0]
    params = gpt_params(CFG, seed=1)
    params["blocks"] = jax.tree.map(lambda x: 3 * x, params["blocks"])
    return graphdef, params


@pytest.fixture(scope="module")
def gen(model):
    """One Generator for the module, so tests share its compiled buckets."""
    return Generator(model[0], CTX)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, params, ids):
    return nnx.merge(graphdef, params)(ids)


def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Re-run the full forward (no cache) over prompt + generated, take the argmax; n times.

    The sequence sits right-padded in one (1, CTX) buffer: attention is causal, so the pads after it change
    nothing, and one compile serves every length.
    """
    graphdef, params = model
    seq = list(prompt)
    for _ in range(n):
        buf = np.zeros((1, CTX), np.int32)
        buf[0, :len(seq)] = seq
        seq.append(int(jnp.argmax(_full_logits(graphdef, params, buf)[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def greedy(model) -> list[list[int]]:
    return [naive_greedy(model, p, N_NEW) for p in PROMPTS]


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_greedy_matches_naive_full_forward(model, gen, greedy):
    out = gen(model[1], [PROMPTS[0]], max_new_tokens=N_NEW).ids
    assert out == [greedy[0]]
    assert len(set(greedy[0])) > 3  # the model's continuation depends on context (see the fixture)


def test_batch_rows_equal_each_prompt_alone(model, gen, greedy):
    """Prompts of lengths 5, 11, 3 are left-padded into one batch; each row is what that prompt gives alone."""
    batch = gen(model[1], PROMPTS, max_new_tokens=N_NEW).ids
    alone = [gen(model[1], [p], max_new_tokens=N_NEW).ids[0] for p in PROMPTS]
    assert batch == alone
    assert batch == greedy


def test_eos_stops_only_its_row(model, gen, greedy):
    eos = greedy[0][3]
    assert eos not in greedy[0][:3]  # so row 0 must stop exactly after 3 tokens
    expected = [g[:g.index(eos)] if eos in g else g for g in greedy]
    assert len(expected[1]) == N_NEW or len(expected[2]) == N_NEW  # another row runs to the end
    steps = []
    out = gen(model[1], PROMPTS, max_new_tokens=N_NEW, eos_id=eos, on_step=lambda ids: steps.append(ids.copy())).ids
    assert out == expected
    assert len(out[0]) == 3 and eos not in out[0]
    assert steps[3][0] == -1  # streaming marks the finished row
    assert [int(s[1]) for s in steps] == out[1][:len(steps)]


# --- sampling -------------------------------------------------------------------------------------------------------


TOP_K = 5
# near-uniform logits (0.05 apart), shuffled per row: without the filter every token is drawn often
SPREAD = np.stack([np.random.default_rng(r).permutation(32) * 0.05 for r in range(2)]).astype(np.float32)
# token 2 most likely, then 0, 3, 1
NUCLEUS = np.log(np.array([[0.3, 0.05, 0.5, 0.15]], np.float32))


@pytest.fixture(scope="module")
def draws() -> dict[str, np.ndarray]:
    """(n, B) draws of sample_logits over 2000 keys per setting, all from one compiled program."""

    @jax.jit
    @jax.vmap
    def draw(key):
        return {
            "top_k=1": sample_logits(jnp.asarray(SPREAD), key, Sampling(1.0, 1)),
            "top_k": sample_logits(jnp.asarray(SPREAD), key, Sampling(1.0, TOP_K)),
            "unfiltered": sample_logits(jnp.asarray(SPREAD), key, Sampling(1.0)),
            "top_p=0.1": sample_logits(jnp.asarray(NUCLEUS), key, Sampling(1.0, top_p=0.1)),
            "top_p=0.7": sample_logits(jnp.asarray(NUCLEUS), key, Sampling(1.0, top_p=0.7)),
        }

    return {k: np.asarray(v) for k, v in draw(jax.random.split(jax.random.key(0), 2000)).items()}


def test_top_k_1_is_greedy(draws):
    assert (draws["top_k=1"] == SPREAD.argmax(-1)).all()


def test_top_k_draws_only_from_the_k_highest(draws):
    for row in range(2):
        top = set(np.argsort(-SPREAD[row])[:TOP_K].tolist())
        assert set(draws["top_k"][:, row].tolist()) == top  # never outside the top k, and each of them reachable
        assert len(set(draws["unfiltered"][:, row].tolist())) > 2 * TOP_K  # (unfiltered, far more are drawn)


def test_top_p_keeps_the_nucleus(draws):
    assert set(draws["top_p=0.1"][:, 0].tolist()) == {2}  # below the top token's mass: the argmax only
    # 0.7: token 0 joins (mass before it is 0.5 < 0.7); token 3 does not (0.8 already reached)
    assert set(draws["top_p=0.7"][:, 0].tolist()) == {2, 0}


@pytest.mark.parametrize("draw", ["cdf", "gumbel"])
def test_draws_follow_the_softmax_across_blocks(draw):
    """Either draw picks each id as often as its softmax probability says: a 700-id vocabulary (not a multiple of
    `DRAW_BLOCK`) with its mass in three blocks and masked ids (-inf) among them; 20,000 draws, each probability
    within 4 standard errors; masked ids and the padding never drawn. Gumbel's is `jax.random.categorical`'s, the
    draw of older runs, token for token."""
    logits = np.full((1, 700), -np.inf, np.float32)
    logits[0, [3, 255, 256, 400, 699]] = [0.0, 1.0, -0.5, 2.0, 0.5]
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    keys = jax.random.split(jax.random.key(0), 20_000)
    ids = np.asarray(jax.jit(jax.vmap(lambda k: sample_logits(jnp.asarray(logits), k, Sampling(1.0, draw=draw))[0]))(
        keys))
    counts = np.bincount(ids, minlength=700)
    assert counts.sum() == len(ids) and set(np.flatnonzero(counts)) <= {3, 255, 256, 400, 699}
    se = np.sqrt(probs * (1 - probs) / len(ids))
    np.testing.assert_array_less(np.abs(counts / len(ids) - probs), 4 * se + 1e-12)
    if draw == "gumbel":
        categorical = jax.jit(jax.vmap(lambda k: jax.random.categorical(k, jnp.asarray(logits[0]))))(keys)
        assert (ids == np.asarray(categorical)).all()
    with pytest.raises(ValueError, match="draw='inverse': not one of cdf, gumbel"):
        Sampling.of(1.0, None, None, "inverse")


@pytest.mark.parametrize("heads,kv_heads,t,softcap", [(9, 3, 1, None), (9, 3, 5, None), (4, 4, 1, 30.0),
                                                       (4, 4, 3, None)])
def test_attention_over_the_cache_layout_equals_attention(heads, kv_heads, t, softcap):
    """`cached_attention` over keys (B, K, H, S) and values (B, K, S, H), the cache's layout, gives `attention`'s
    output over the same keys and values laid (B, S, K, H), under a mask with holes, to 1e-6: grouped and plain
    heads, one query (a decode step) and several (a prefill or a turn's block), with and without a softcap."""
    from jaxtune.models.layers import attention, cached_attention

    rng = np.random.default_rng(heads + t)
    b, s, h = 3, 24, 16
    q = jnp.asarray(rng.standard_normal((b, t, heads, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv_heads, h)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.7)
    want = attention(q, k, v, mask, None, softcap=softcap)
    got = cached_attention(q, jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 1, 3)), mask, None,
                           softcap=softcap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_temperature_sampling_is_seeded(model, gen, greedy):
    def run(seed):
        return gen(model[1], PROMPTS, max_new_tokens=N_NEW, temperature=1.0, seed=seed).ids

    a = run(3)
    assert run(3) == a
    assert run(4) != a
    assert a != greedy
    assert [len(r) for r in a] == [N_NEW] * len(PROMPTS)


# --- shapes, buckets and limits -------------------------------------------------------------------------------------


def test_compiles_once_per_bucket(model):
    """Batch generation: one program per (prompt bucket, cache bucket); streaming: one prefill per (prompt bucket,
    cache bucket), one chunked decode loop per cache bucket; power-of-two buckets >= 16."""
    assert [bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    gen = Generator(model[0], CTX)
    params = model[1]

    def run(prompt_len, max_new_tokens=20, **kw):
        gen(params, [list(range(1, prompt_len + 1))], max_new_tokens=max_new_tokens, **kw)
        return gen.compiles

    assert run(5) == 1  # prompt bucket 16, cache bucket bucket(16 + 20) = 64: the whole generation, one program
    assert run(9) == 1  # same buckets: nothing new
    assert run(20) == 2  # prompt bucket 32, cache still bucket(32 + 20) = 64
    assert run(40) == 3  # prompt bucket 64, cache bucket(64 + 20) = 128
    assert run(33) == 3
    stream = {"on_step": lambda ids: None}
    assert run(5, **stream) == 5  # streaming: a prefill and a decode loop (chunks of 8) for buckets 16 / 64
    assert run(9, **stream) == 5
    assert run(20, **stream) == 6  # a prefill only: the decode loop of cache bucket 64 is there
    assert run(20, max_new_tokens=3, **stream) == 6  # fewer new tokens than a chunk: the same loop, ended early


def test_packed_prefill_generates_what_the_padded_one_does(model):
    """Distinct prompts of varied lengths are prefilled packed several to a row (`pack_prompts`: no padding, each
    prompt attending to itself only) and their keys and values placed as the left-padded rows': the same greedy
    and sampled tokens as the padded prefill, log-probs to 1e-5 (float32, sums in another order); the rows round up
    to a quarter, half, 5/8 or 3/4 of the padded positions, one program each (measured here: 16 prompts of 4-60
    tokens need 5/8: 5 rows of 128), and a batch of one is not packed."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in rng.integers(4, 61, 16)]
    packed = pack_prompts(prompts, 64)
    assert packed["tokens"].shape == (5, 128) and int(np.min(packed["segments"])) == 0
    assert int(np.count_nonzero(packed["segments"])) == sum(len(p) for p in prompts)  # every token once
    assert pack_prompts(prompts[:1], 64) is None and pack_prompts([[1] * 60] * 16, 64) is None
    padded, packing = Generator(model[0], CTX), Generator(model[0], CTX)
    padded.pack = False
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9, "seed": 2}):
        want, got = padded(model[1], prompts, max_new_tokens=8, **kw), packing(model[1], prompts, max_new_tokens=8,
                                                                                **kw)
        assert got.ids == want.ids and len({tuple(r) for r in got.ids}) > 8
        assert max(abs(a - b) for x, y in zip(got.logps, want.logps) for a, b in zip(x, y)) <= 1e-5
    assert packing.compiles == padded.compiles == 2  # greedy and top-p: one program each


def test_batch_and_streaming_generation_sample_the_same_tokens(model):
    """The on-device loop draws every position with the key the streaming path uses: the same tokens, sampled or
    greedy, with stop ids; its log-probs are those of the tempered distribution at each sampled token."""
    gen = Generator(model[0], CTX)
    params = model[1]
    prompts = [list(range(1, 6)), list(range(3, 20)), [7]]
    for kw in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 5}, {"temperature": 1.3, "top_k": 20, "seed": 1}):
        first = gen(params, prompts, max_new_tokens=12, **kw).ids
        eos = first[1][3]  # a token the second row samples: it stops there (and maybe others do earlier)
        batch, logps = dataclasses.astuple(gen(params, prompts, max_new_tokens=12, eos_id=[eos, 10_000],
                                               keep_stop=True, **kw))
        streamed = gen(params, prompts, max_new_tokens=12, eos_id=[eos, 10_000], keep_stop=True,
                       on_step=lambda ids: None, **kw)
        assert batch == streamed.ids == [r[:r.index(eos) + 1] if eos in r else r for r in first]
        np.testing.assert_allclose(np.concatenate(streamed.logps), np.concatenate(logps), rtol=1e-5, atol=1e-5)
        assert len(first[0]) == 12 and batch[1][-1] == eos
        assert [len(x) for x in logps] == [len(x) for x in batch]
        scale = kw["temperature"] or 1.0
        row = prompts[0] + batch[0]
        logits = jax.device_get(nnx.merge(*model)(jnp.asarray([row])))[0] / scale
        want = [jax.nn.log_softmax(logits[len(prompts[0]) - 1 + t])[tok] for t, tok in enumerate(batch[0])]
        np.testing.assert_allclose(logps[0], want, rtol=1e-4, atol=1e-5)


def test_prompt_longer_than_context_raises(model, gen):
    for n in (CTX, CTX + 50):
        with pytest.raises(ValueError, match=f"{n} tokens; the model's context is {CTX}"):
            gen(model[1], [[1] * n], max_new_tokens=1)
    with pytest.raises(ValueError, match="at least one token"):
        gen(model[1], [[1, 2], []], max_new_tokens=1)


def test_max_new_tokens_clamped_to_context(model, gen, caplog):
    prompt = np.random.default_rng(1).integers(0, CFG.vocab_size, CTX - 8).tolist()
    with caplog.at_level(logging.WARNING, logger="jaxtune.generate"):
        out = gen(model[1], [prompt], max_new_tokens=50).ids
    assert out == [naive_greedy(model, prompt, 8)]  # prompt + output fill the context exactly
    assert "limiting new tokens to 8" in caplog.text


def test_a_group_is_prefilled_once_and_samples_as_its_rows(model):
    """GRPO's G completions of a prompt: ``group=G`` prefills each prompt once and repeats its cache, and samples
    exactly the tokens (and log-probs) of prefilling every row; prompts not in runs of G are refused."""
    gen = Generator(model[0], CTX)
    prompts = [p for p in (list(range(1, 6)), list(range(3, 20))) for _ in range(3)]
    kw = {"max_new_tokens": 10, "temperature": 1.0, "seed": 3}
    rows, row_logps = dataclasses.astuple(gen(model[1], prompts, **kw))
    grouped, grouped_logps = dataclasses.astuple(gen(model[1], prompts, group=3, **kw))
    assert grouped == rows and len({tuple(r) for r in rows}) == 6  # the draws differ within a group
    np.testing.assert_allclose(grouped_logps, row_logps, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="runs of 3 equal ones"):
        gen(model[1], prompts[1:] + prompts[:1], group=3, **kw)


@pytest.mark.parametrize("scan", [False, True])
def test_lora_samples_with_its_adapters_merged(scan):
    """A LoRA model's sampler merges the adapters into a copy of the adapted kernels once per call and samples the
    graph without adapters: the same greedy tokens and sampled tokens as the adapter graph (log-probs to 1e-5), the
    adapters and the base untouched, and not the base model's tokens (the adapters count). Layers stacked
    (model.scan_layers) or not."""
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.config import load_config

    cfg = load_config(None, ["model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64",
                             "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128", "model.vocab_size=256",
                             "model.max_seq_len=64", "model.lora.rank=4", f"model.scan_layers={str(scan).lower()}"])
    spec = make_state_spec(cfg, 256, sharding.make_mesh(1, 1, 1, jax.devices()[:1]))
    rng = np.random.default_rng(0)
    moved = lambda tree, s: jax.tree.map(lambda x: x + jnp.asarray(s * rng.standard_normal(x.shape), x.dtype), tree)
    adapters, (base,) = moved(spec.init(0).params, 0.3), spec.load_frozen(0)
    weights = spec.weights(adapters, (base,))
    before = jax.device_get(weights)
    merged_gen, adapter_gen = spec.generator(), Generator(spec.graphdef, 64)
    assert merged_gen.plain is not None
    prompts = [rng.integers(1, 256, n).tolist() for n in (4, 9, 13)]
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        merged, adapted = (g(weights, prompts, max_new_tokens=12, **kw) for g in (merged_gen, adapter_gen))
        assert merged.ids == adapted.ids
        np.testing.assert_allclose(np.concatenate(merged.logps), np.concatenate(adapted.logps),
                                   rtol=1e-5, atol=1e-5)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(weights)),
                                                     jax.tree.leaves(before), strict=True))
    base_only = merged_gen.plain(base, prompts, max_new_tokens=12).ids
    assert base_only != merged_gen(weights, prompts, max_new_tokens=12).ids


# --- sessions (multi-turn rollouts) ---------------------------------------------------------------------------------


def _llama(n_layer: int = 2):
    """(graphdef, params) of a tiny random Llama (RoPE: positions matter, GQA)."""
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.config import load_config

    cfg = load_config(None, ["model.family=llama", "model.preset=tiny", f"model.n_layer={n_layer}",
                             "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128",
                             "model.vocab_size=256", "model.max_seq_len=128"])
    spec = make_state_spec(cfg, 256, sharding.make_mesh(1, 1, 1, jax.devices()[:1]))
    params = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, spec.init(0).params)
    return spec.graphdef, params


def _turns_match_prefilling_again(gen, params, session, prompts, first, turns, stop, rng, count):
    """Runs the session's ``turns`` (each the rows continued, random tokens appended to each) and checks each turn's
    tokens and log-probs against the whole conversations prefilled again (greedy); each turn's lengths."""
    conversations = [list(p) + list(t) for p, t in zip(prompts, first.ids)]
    lengths = [[len(t) for t in first.ids]]
    for turn, rows in enumerate(turns):
        appended = [rng.integers(1, 250, 2 + 3 * j).tolist() for j in range(len(rows))]
        got = count(functools.partial(session.extend, rows, appended, max_new_tokens=12, seed=turn))
        whole = [conversations[i] + a for i, a in zip(rows, appended)]
        again = gen(params, whole, max_new_tokens=12, eos_id=[stop], keep_stop=True)
        assert got.ids == again.ids, (turn, got.ids, again.ids)
        np.testing.assert_allclose(np.concatenate(got.logps), np.concatenate(again.logps), rtol=1e-4, atol=1e-4)
        for i, a, t in zip(rows, appended, got.ids):
            conversations[i] += a + t
        lengths.append([len(t) for t in got.ids])
    return lengths


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("group", [1, 2])
def test_a_session_continues_turns_as_the_whole_conversation_would(model, family, group):
    """A multi-turn rollout's session: after a first turn, tokens appended to some rows (a tool's result) and their
    next turn generated from the cache give the tokens (greedy, and sampled with the same key) and log-probs that
    generating from each row's whole conversation prefilled again gives; rows not continued are left alone; two
    more turns, the cache growing past its first bucket. Stop ids end rows at different lengths (so the rows' slots
    have gaps). GPT-2 (learned positions) and Llama (RoPE, GQA); groups prefilled once. (Sampled turns draw with
    the session's slots in their keys, so they are not a fresh generation's draws: greedy tokens and log-probs are
    what is compared.)"""
    graphdef, params = model if family == "gpt2" else _llama()
    gen = Generator(graphdef, 128)
    rng = np.random.default_rng(1)
    prompts = [p for p in (rng.integers(1, 250, 6).tolist(), rng.integers(1, 250, 13).tolist()) for _ in range(2)]
    prompts = prompts if group == 2 else [prompts[0], prompts[2], rng.integers(1, 250, 3).tolist(), prompts[1]]
    first_plain = gen(params, prompts, max_new_tokens=12, keep_stop=True)
    stop = first_plain.ids[1][3]  # a token row 1 draws early: rows stop at different lengths
    kw = {"max_new_tokens": 12, "eos_id": [stop], "temperature": 0.0}
    counted = {"traces": 0}

    def count(call):  # the programs the session's own calls trace
        before = gen.traces
        out = call()
        counted["traces"] += gen.traces - before
        return out

    first, session = count(lambda: gen.open(params, prompts, group=group, **kw))
    assert first.ids == gen(params, prompts, keep_stop=True, **kw).ids
    lengths = _turns_match_prefilling_again(gen, params, session, prompts, first, ([0, 1, 3], [1, 3]), stop, rng,
                                            count)
    assert session.key_valid.shape[1] > 64  # the cache grew past its first bucket (16 + 12 -> 32 -> ...)
    assert len({n for turn in lengths for n in turn}) > 1 and max(map(max, lengths)) > 1, lengths
    # programs: the first turn's, then per turn one for its (appended block bucket, cache bucket) and one per cache
    # growth; the same turns again compile nothing more
    traces = counted["traces"]
    assert traces <= 1 + 2 + 2, traces
    _, again = count(lambda: gen.open(params, prompts, group=group, **kw))
    count(lambda: again.extend([0, 1, 3], [[5, 6], [7, 8, 9, 10, 11], [1] * 8], max_new_tokens=12, seed=0))
    assert counted["traces"] == traces


def test_a_session_keeps_only_the_rows_still_going():
    """16 rollouts (groups of 2), 5 of them continued, then 2 of those: the first continued turn cuts the session to
    a bucket of 8 rows (their cache gathered once), the next stays there; each turn's tokens and log-probs are still
    the whole conversations' prefilled again. A row left out of a turn cannot be continued later. Programs: the first
    turn's, the gather, one per (rows, appended block, cache) bucket, one per cache growth."""
    graphdef, params = _llama()
    gen = Generator(graphdef, 128)
    rng = np.random.default_rng(2)
    prompts = [p for _ in range(8) for p in [rng.integers(1, 250, int(rng.integers(3, 14))).tolist()] * 2]
    stop = gen(params, prompts[:1], max_new_tokens=6, keep_stop=True).ids[0][2]
    kw = {"max_new_tokens": 12, "eos_id": [stop], "temperature": 0.0, "group": 2}
    first, session = gen.open(params, prompts, **kw)
    assert session.key_valid.shape[0] == 16
    sizes, traces = [], [1]  # per turn, the session's rows (its host arrays', its cache's); the programs it traced

    def sized(call):
        before = gen.traces
        out = call()
        traces.append(gen.traces - before)
        sizes.append((session.key_valid.shape[0], jax.tree.leaves(session.cache)[0].shape[1]))
        return out

    _turns_match_prefilling_again(gen, params, session, prompts, first, ([1, 3, 4, 9, 14], [3, 9]), stop, rng, sized)
    assert sizes == [(8, 8), (8, 8)], sizes
    assert traces[1] <= 1 + 1 + 1 and sum(traces) <= 1 + 1 + 2 + 2, traces
    with pytest.raises(ValueError, match=r"rows \[1\] were left out of an earlier turn"):
        session.extend([1, 3], [[5], [6]], max_new_tokens=4, seed=0)
