"""Sampling: token choice from logits (greedy, temperature, top-k, top-p), stop handling, length buckets, and the
native models' KV-cache generator: one prefill over the (left-padded) prompts, then one token per position, all on
device (`Generator`). A batch of distinct prompts of varied lengths is prefilled packed, several to a row without
their padding (`pack_prompts`), its keys and values then placed where the left-padded rows' would be.

Shapes are static per length bucket (powers of two), so a session compiles one program per (batch, prompt bucket,
cache bucket, new tokens), whatever the prompts. Sampling: greedy (temperature 0), temperature, top-k, top-p;
stops at EOS (or any of several stop ids) per sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune.io import host
from jaxtune.models.layers import KVCache, LoraSpec
from jaxtune.models.lora import merged_weights
from jaxtune.models.registry import merge

log = logging.getLogger(__name__)


STREAM_CHUNK = 8  # positions a streaming program decodes before the host sees them


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= n (and >= minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is drawn from a row's logits: greedy (``temperature`` 0), else from logits / ``temperature``
    kept to the ``top_k`` likeliest and to the ``top_p`` nucleus (None: no filter), a token drawn the ``draw`` way
    (`DRAWS`). Hashable: sampling programs are compiled for it."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    draw: str = "cdf"

    @classmethod
    def of(cls, temperature: float, top_k: int | None, top_p: float | None, draw: str = "cdf") -> Sampling:
        """The record of these settings, normalised so that equal settings are one record (0 and 0.0 alike)."""
        if draw not in DRAWS:
            raise ValueError(f"draw={draw!r}: not one of {', '.join(DRAWS)}")
        return cls(float(temperature), None if top_k is None else int(top_k), None if top_p is None else float(top_p),
                   draw)

    def logps(self, logits: jax.Array, ids: jax.Array) -> jax.Array:
        """(B, V) logits, (B,) drawn ids -> (B,) their log-probs under the tempered distribution (logits /
        temperature, before top-k/top-p: the distribution a policy-gradient trainer scores; greedy: temperature 1)."""
        scale = 1.0 if self.temperature == 0.0 else self.temperature
        return jnp.take_along_axis(jax.nn.log_softmax(logits / scale, -1), ids[:, None], -1)[:, 0]


def sample_logits(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """(B, V) float32 logits -> (B,) int32 token ids drawn as ``sampling`` says."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    if temperature == 0.0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        _, keep = jax.lax.top_k(logits, top_k)  # exactly k candidates, even with tied logits
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], keep].set(
            jnp.take_along_axis(logits, keep, -1))
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, -1)
        probs = jax.nn.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (jnp.cumsum(probs, -1) - probs) >= top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    if sampling.draw == "gumbel":
        return jax.random.categorical(key, logits, -1).astype(jnp.int32)
    return drawn(logits, key)


# How a token is drawn from a row's softmax (`Sampling.draw`), the same distribution either way:
# - "cdf": one uniform number a row, the softmax's CDF inverted in two levels (`drawn`);
# - "gumbel": `jax.random.categorical`, a Gumbel number for every id (the draw of runs saved before "cdf", which keep
#   it on resume: `jaxtune.loop`).
DRAWS = ("cdf", "gumbel")
DRAW_BLOCK = 256  # `drawn` picks a block of this many ids, then an id in it


def drawn(logits: jax.Array, key: jax.Array) -> jax.Array:
    """(B, V) logits (-inf: never) -> (B,) ids drawn from their softmax, by inverting its CDF at one uniform number a
    row, in two levels: the block of `DRAW_BLOCK` ids the number falls in, then the id in that block. The same
    distribution as `jax.random.categorical`, which draws V Gumbel numbers a row: at a 49,152-id vocabulary those
    took 17.5 ms of a 32-row decode step on 2 Zen 4 cores, this 0.6 ms. An id without mass is never drawn, even where
    rounding puts the number past a row's last cumulative sum."""
    b, v = logits.shape
    logits = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, -v % DRAW_BLOCK)), constant_values=-jnp.inf)
    mass = jnp.exp(logits - jnp.max(logits, -1, keepdims=True)).reshape(b, -1, DRAW_BLOCK)  # (B, blocks, block)
    blocks = mass.sum(-1)
    upto = jnp.cumsum(blocks, -1)
    u = jax.random.uniform(key, (b, 1), jnp.float32) * upto[:, -1:]
    j = _first_past(upto, blocks, u)
    inner = jnp.take_along_axis(mass, j[:, None, None], 1)[:, 0]  # (B, block): the chosen block's masses
    start = jnp.take_along_axis(upto - blocks, j[:, None], -1)
    i = _first_past(jnp.cumsum(inner, -1) + start, inner, u)
    return (j * DRAW_BLOCK + i).astype(jnp.int32)


def _first_past(cumulative: jax.Array, mass: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, the first index with mass whose cumulative sum passes ``u``; the last index with mass if none does
    (rounding)."""
    has = mass > 0
    past = (cumulative > u) & has
    last = has.shape[-1] - 1 - jnp.argmax(has[:, ::-1], -1)
    return jnp.where(past.any(-1), jnp.argmax(past, -1), last)


def stop_tuple(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """The stop ids as a (hashable) tuple: none, one or several."""
    return () if eos_id is None else (int(eos_id),) if isinstance(eos_id, int) else tuple(int(e) for e in eos_id)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a generator returns, per prompt: ``ids``, the new token ids (the stop id excluded, unless
    ``keep_stop``), and ``logps``, each of those ids' log-prob under the tempered distribution it was drawn from
    (`Sampling.logps`)."""

    ids: list[list[int]]
    logps: list[list[float]]


def row_logps(drawn: Sequence[np.ndarray], ids: Sequence[Sequence[int]]) -> list[list[float]]:
    """Each row's log-probs from ``drawn``, the (B,) log-probs of each generated position: a row's ids are its first
    len(ids) positions."""
    by_row = np.stack(drawn, axis=1)
    return [by_row[i, :len(row)].tolist() for i, row in enumerate(ids)]


class PromptError(ValueError):
    """A prompt the model cannot continue: empty, or as long as its context. The message says which prompt."""


def check_prompts(prompts: Sequence[Sequence[int]], max_seq_len: int, max_new_tokens: int) -> int:
    """Refuse empty prompts and prompts that fill the context (`PromptError`); the number of new tokens that fit
    after the longest prompt (``max_new_tokens`` or fewer, with a warning)."""
    if not prompts:
        raise PromptError("generate: no prompts; give at least one")
    for i, p in enumerate(prompts, 1):
        if len(p) == 0:
            raise PromptError(f"generate: prompt {i} is empty (0 tokens); a prompt needs at least one token")
        if len(p) >= max_seq_len:
            raise PromptError(f"generate: prompt {i} has {len(p)} tokens; the model's context is {max_seq_len} "
                              "tokens, prompt and new tokens together: shorten it, or pass --truncate left to keep "
                              "its last tokens")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_seq_len:
        max_new_tokens = max_seq_len - longest
        log.warning("generate: limiting new tokens to %d to fit the %d-token context", max_new_tokens, max_seq_len)
    return max_new_tokens


def truncate_left(prompts: Sequence[Sequence[int]], max_seq_len: int, max_new_tokens: int) -> list[list[int]]:
    """Each prompt that leaves no room for ``max_new_tokens`` in the context keeps only its last tokens: as many as
    leave that room, and at least one (a warning names each prompt cut)."""
    keep = max(1, max_seq_len - max_new_tokens)
    for i, p in enumerate(prompts, 1):
        if len(p) > keep:
            log.warning("generate: prompt %d has %d tokens; keeping its last %d so that %d new tokens fit the "
                        "%d-token context", i, len(p), keep, max_seq_len - keep, max_seq_len)
    return [list(p[-keep:]) for p in prompts]


def collect(ids: np.ndarray, out: list[list[int]], done: np.ndarray, eos_id: int | Sequence[int] | None,
            on_step: Callable[[np.ndarray], None] | None, keep_stop: bool = False) -> bool:
    """Append one generated position ``ids`` (B,) to the unfinished rows of ``out``, marking rows that emitted a
    stop id as ``done`` (in place; the stop id appended too with ``keep_stop``); calls ``on_step`` (stopped rows as
    -1). Returns whether every row is done."""
    stops = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    for i, tok in enumerate(ids):
        if not done[i]:
            if int(tok) in stops:
                done[i] = True
                if keep_stop:
                    out[i].append(int(tok))
            else:
                out[i].append(int(tok))
    if on_step is not None:
        on_step(np.where(done, -1, ids))
    return bool(done.all())


PACKED_SPAN = 2  # a packed row holds this many prompt buckets' positions (two prompts of the bucket, or more shorter)
PACKED_SHARES = (1 / 4, 1 / 2, 5 / 8, 3 / 4)  # of the padded positions, what a packed prefill rounds up to


def pack_prompts(prompts: Sequence[Sequence[int]], bucket_len: int) -> dict[str, np.ndarray] | None:
    """The prefill of ``prompts`` (each at most ``bucket_len`` tokens, left-padded to it otherwise) packed without
    their padding: first-fit decreasing into rows of W = `PACKED_SPAN` x ``bucket_len`` positions, the row count
    rounded up so that the rows hold 1/4, 1/2, 5/8 or 3/4 of the padded batch's positions (at most four programs
    per batch and prompt bucket, not one per packing); None when 3/4 do not hold them (too little saved to pay a
    program). Arrays: ``tokens``, ``positions`` (restarting per prompt) and ``segments`` (1, 2, ... per prompt in
    its row, 0 padding), each (R, W); ``gather`` (B, ``bucket_len``), for each left-padded slot of each prompt the
    flat (R x W) index of its token (0 where padding); ``last`` (B,), each prompt's last token's index."""
    b, width = len(prompts), PACKED_SPAN * bucket_len
    order = sorted(range(b), key=lambda i: -len(prompts[i]))
    free: list[int] = []  # positions left per row
    where = [(0, 0)] * b  # prompt -> (row, first slot)
    for i in order:
        n = len(prompts[i])
        row = next((r for r, f in enumerate(free) if f >= n), None)
        if row is None:
            free.append(width)
            row = len(free) - 1
        where[i] = (row, width - free[row])
        free[row] -= n
    rows = next((r for r in (math.ceil(b * k / PACKED_SPAN) for k in PACKED_SHARES) if r >= len(free)), None)
    if rows is None or rows * width >= b * bucket_len:  # a batch of one or two: nothing to save
        return None
    out = {k: np.zeros((rows, width), np.int32) for k in ("tokens", "positions", "segments")}
    gather, last = np.zeros((b, bucket_len), np.int32), np.zeros(b, np.int32)
    segment = [0] * rows
    for i, p in enumerate(prompts):
        row, at = where[i]
        n = len(p)
        segment[row] += 1
        out["tokens"][row, at:at + n] = p
        out["positions"][row, at:at + n] = np.arange(n)
        out["segments"][row, at:at + n] = segment[row]
        gather[i, bucket_len - n:] = row * width + at + np.arange(n)
        last[i] = row * width + at + n - 1
    return {**out, "gather": gather, "last": last}


@dataclasses.dataclass(frozen=True)
class Decode:
    """What one generation program is compiled for, its one static argument: the ``sampling``, the ``stops`` that
    end a row, and the shapes: ``cache_len`` KV-cache slots, ``max_new`` positions (batch generation's buffers),
    ``group`` rows per distinct prompt, ``chunk`` positions per streaming program. A program's record holds only
    what that program reads, the rest at their defaults: it compiles once per value it depends on."""

    sampling: Sampling
    stops: tuple[int, ...] = ()
    cache_len: int = 0
    max_new: int = 0
    group: int = 1
    chunk: int = 0
    keep_cache: bool = False  # a multi-turn session's first turn: the program returns its cache too (`Session`)

    def stopped(self, ids: jax.Array) -> jax.Array:
        """(B,) ids -> (B,) whether each is a stop id."""
        return jnp.isin(ids, jnp.asarray(self.stops if self.stops else (-1,), jnp.int32))


class Prompts(NamedTuple):
    """The distinct prompts left-padded into one (P, ``p_len``) block, every prompt ending at slot p_len - 1:
    ``tokens``, ``valid`` (the real slots), ``lengths`` (B,) of every row's prompt, and the cache's ``cache_len``."""

    tokens: np.ndarray
    valid: np.ndarray
    lengths: np.ndarray
    cache_len: int

    @classmethod
    def left_padded(cls, prompts: Sequence[Sequence[int]], group: int, max_new_tokens: int,
                    max_seq_len: int) -> Prompts:
        """The block of ``prompts[::group]`` in power-of-two buckets (`bucket`) that hold ``max_new_tokens`` more."""
        longest = max(len(p) for p in prompts)
        p_len = min(bucket(longest), max_seq_len)
        cache_len = min(bucket(p_len + max_new_tokens), max_seq_len)
        if p_len + max_new_tokens > cache_len:  # a short context: bucket the prompt exactly
            p_len = longest
        distinct = prompts[::group]
        tokens = np.zeros((len(distinct), p_len), np.int32)
        valid = np.zeros((len(distinct), p_len), bool)
        for i, p in enumerate(distinct):
            tokens[i, p_len - len(p):] = p
            valid[i, p_len - len(p):] = True
        return cls(tokens, valid, np.array([len(p) for p in prompts], np.int32), cache_len)


class Generator:
    """Jitted generation for one model graph; reuse it to keep compiled buckets.

    Batch generation (no ``on_step``) is one compiled program per (batch, prompt bucket, cache bucket, new tokens):
    the prefill, then a `jax.lax.while_loop` over positions that samples on device, writes each token and its
    log-prob into (B, max_new_tokens) buffers, tracks which rows have emitted a stop id, and leaves the loop once all
    have. The host sees the tokens once, at the end. Streaming (``on_step``) is two programs: the prefill, and the
    same loop run ``STREAM_CHUNK`` positions at a time (the cache donated, updated in place), the host handing each
    chunk's tokens to ``on_step`` position by position. Both draw position t's token with the key
    ``fold_in(key(seed), prompt bucket + t)``, so they sample the same tokens. Every program takes its static
    settings as one `Decode` record.
    """

    def __init__(self, graphdef: nnx.GraphDef, max_seq_len: int,
                 merged: tuple[nnx.GraphDef, LoraSpec] | None = None, windowed: bool = False):
        self.graphdef = graphdef
        self.max_seq_len = max_seq_len
        # sliding-window attention counts cache slots: a `Session`'s turns (gaps between rows' slots) need whole rows
        self.windowed = windowed
        self.traces = 0  # traced programs (whole generations, or prefill + decode), for compile-count checks
        # LoRA: (the graph without adapters, their spec): weights (adapters, base) are merged once per call
        # (`merged_weights`) and sampled by that graph, without the adapters' matmuls on every token
        self.plain = None if merged is None else Generator(merged[0], max_seq_len)
        self.lora = None if merged is None else merged[1]
        # batch generation of distinct prompts prefills them packed (`pack_prompts`) where that saves positions
        self.pack = True

    @property
    def compiles(self) -> int:
        return self.traces + (self.plain.compiles if self.plain is not None else 0)

    def _start(self, model, tokens, valid, key, decode: Decode, packed=None):
        """The prefill: the cache of the left-padded prompts, the valid key slots and the first sampled token with
        its logits. ``decode.group`` > 1: each prompt is prefilled once and its cache and logits repeated for its
        ``group`` rows, which then sample apart. ``packed`` (`pack_prompts`): the prompts computed packed several to
        a row instead, without their padding, and their keys and values then placed as the left-padded rows' would
        be."""
        b, p = tokens.shape
        cache_len, group = decode.cache_len, decode.group
        key_valid = jnp.concatenate([valid, jnp.ones((b, cache_len - p), bool)], axis=1)  # (B, S)
        if packed is not None:
            last, cache = self._prefill_packed(model, packed, b, p, cache_len)
        else:
            positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
            cache = model.init_cache(b, cache_len)
            hidden, cache = model(tokens, positions=positions, cache=cache, index=0, key_valid=key_valid,
                                  return_hidden=True)
            last = model.logits(hidden[:, -1:])[:, 0]  # the head on the last position only (prompts end there)
        if group > 1:  # a cache's rows are its axis 1
            last, key_valid = jnp.repeat(last, group, axis=0), jnp.repeat(key_valid, group, axis=0)
            cache = jax.tree.map(lambda c: jnp.repeat(c, group, axis=1), cache)
        nxt = sample_logits(last, jax.random.fold_in(key, p), decode.sampling)
        return nxt, last, cache, key_valid

    @staticmethod
    def _prefill_packed(model, packed: dict[str, jax.Array], b: int, p: int, cache_len: int):
        """(last-token logits (B, V), the `KVCache` of ``cache_len`` slots) of prompts packed into (R, W) rows
        (`pack_prompts`): one forward over the rows, each prompt attending to itself only (its segment), then each
        prompt's keys and values gathered into its own row's slots p - len .. p - 1 (left padding)."""
        tokens, segments = packed["tokens"], packed["segments"]
        r, w = tokens.shape
        cache = model.init_cache(r, w)
        hidden, cache = model(tokens, positions=packed["positions"], cache=cache, index=0, key_valid=segments > 0,
                              segment_ids=segments, return_hidden=True)
        last = model.logits(hidden.reshape(r * w, hidden.shape[-1])[packed["last"]][:, None])[:, 0]

        def place(c):  # (L, R, W, K, H) -> (L, B, cache_len, K, H)
            rows = c.reshape(c.shape[0], r * w, *c.shape[3:])[:, packed["gather"]]
            return jnp.concatenate([rows, jnp.zeros((c.shape[0], b, cache_len - p, *c.shape[3:]), c.dtype)], 2)

        return last, KVCache.of_slots(*(place(c) for c in cache.by_slot()))

    @functools.partial(jax.jit, static_argnames=("self", "decode"))
    def _prefill(self, params, tokens, valid, key, *, decode: Decode):
        """Streaming's first program: (the first token (B,), its log-prob, the cache, the valid key slots)."""
        self.traces += 1
        nxt, logits, cache, key_valid = self._start(merge(self.graphdef, params), tokens, valid, key, decode)
        return nxt, decode.sampling.logps(logits, nxt), cache, key_valid

    def _loop(self, params, state, until, *, p, key, lengths, key_valid, decode: Decode):
        """Decode from ``state`` = (t, token, cache, done, ids, logps) while ``t < until`` and some row has not
        stopped: a `jax.lax.while_loop` that feeds position t - 1's token, samples position t's on device (key
        ``fold_in(key, p + t)``, ``p`` the prompt bucket) and writes it and its log-prob (`Sampling.logps`) into
        column t of ``ids``/``logps``, or of (B, chunk) buffers when those are shorter (column ``t % chunk``: the
        streaming path's chunks)."""
        width = state[4].shape[1]

        def more(carry):
            t, _, _, done, _, _ = carry
            return (t < until) & ~jnp.all(done)

        def step(carry):
            t, token, cache, done, ids, logps = carry
            model = merge(self.graphdef, params)  # at the loop body's trace level (nnx.scan'd layers check it)
            logits, cache = model(token[:, None], positions=(lengths + t - 1)[:, None], cache=cache,
                                  index=p + t - 1, key_valid=key_valid)
            nxt = sample_logits(logits[:, -1], jax.random.fold_in(key, p + t), decode.sampling)
            logp = decode.sampling.logps(logits[:, -1], nxt)[:, None]
            ids = jax.lax.dynamic_update_slice(ids, nxt[:, None], (0, t % width))
            logps = jax.lax.dynamic_update_slice(logps, logp, (0, t % width))
            return t + 1, nxt, cache, done | decode.stopped(nxt), ids, logps

        return jax.lax.while_loop(more, step, state)

    @functools.partial(jax.jit, static_argnames=("self", "decode"))
    def _generate(self, params, tokens, valid, key, lengths, packed=None, *, decode: Decode):
        """(B, max_new) tokens, (B, max_new) their log-probs (`Sampling.logps`), and the positions generated.
        ``tokens``: the B / ``decode.group`` distinct prompts, each generating ``group`` rows."""
        self.traces += 1
        model = merge(self.graphdef, params)
        p, b = tokens.shape[1], tokens.shape[0] * decode.group
        nxt, logits, cache, key_valid = self._start(model, tokens, valid, key, decode, packed)
        ids = jnp.zeros((b, decode.max_new), jnp.int32).at[:, 0].set(nxt)
        logps = jnp.zeros((b, decode.max_new), jnp.float32).at[:, 0].set(decode.sampling.logps(logits, nxt))
        state = (jnp.int32(1), nxt, cache, decode.stopped(nxt), ids, logps)
        t, _, cache, _, ids, logps = self._loop(params, state, decode.max_new, p=p, key=key, lengths=lengths,
                                                key_valid=key_valid, decode=decode)
        return (ids, logps, t, cache) if decode.keep_cache else (ids, logps, t)

    @functools.partial(jax.jit, static_argnames=("self", "decode"), donate_argnames=("cache",))
    def _extend(self, params, cache, key_valid, tokens, positions, slot, key, lengths, done, *, decode: Decode):
        """A session's next turn (`Session.extend`): the (B, C) ``tokens`` written from cache slot ``slot`` at
        their ``positions`` (each row's right-aligned, its padding invalid in ``key_valid``), then decoding from
        slot ``slot + C`` as `_generate` does, the rows ``done`` already left alone. (ids, logps, positions
        generated, the cache)."""
        self.traces += 1
        model = merge(self.graphdef, params)
        b, c = tokens.shape
        hidden, cache = model(tokens, positions=positions, cache=cache, index=slot, key_valid=key_valid,
                              return_hidden=True)
        last = model.logits(hidden[:, -1:])[:, 0]
        p = slot + c
        nxt = sample_logits(last, jax.random.fold_in(key, p), decode.sampling)
        ids = jnp.zeros((b, decode.max_new), jnp.int32).at[:, 0].set(nxt)
        logps = jnp.zeros((b, decode.max_new), jnp.float32).at[:, 0].set(decode.sampling.logps(last, nxt))
        state = (jnp.int32(1), nxt, cache, done | decode.stopped(nxt), ids, logps)
        t, _, cache, _, ids, logps = self._loop(params, state, decode.max_new, p=p, key=key, lengths=lengths,
                                                key_valid=key_valid, decode=decode)
        return ids, logps, t, cache

    @functools.partial(jax.jit, static_argnames=("self", "slots"))
    def _grown(self, cache, *, slots: int):
        """The ``cache`` with ``slots`` slots (empty ones added at the end)."""
        self.traces += 1
        return cache.grown(slots)

    @functools.partial(jax.jit, static_argnames=("self",))
    def _rows(self, cache, keep):
        """The ``cache``'s rows ``keep`` ((B',) indices), in that order."""
        self.traces += 1
        return jax.tree.map(lambda c: jnp.take(c, keep, axis=1), cache)

    @functools.partial(jax.jit, static_argnames=("self", "decode"), donate_argnames=("cache",))
    def _chunk(self, params, cache, key_valid, token, p, t, max_new, key, lengths, done, *, decode: Decode):
        """Streaming: up to ``decode.chunk`` positions from position ``t`` (token ``token`` at t - 1) in one program,
        the cache updated in place; (ids and log-probs (B, chunk) in columns ``t % chunk`` on, the next position,
        the last token, the cache, the rows done)."""
        self.traces += 1
        b, chunk = token.shape[0], decode.chunk
        state = (t, token, cache, done, jnp.zeros((b, chunk), jnp.int32), jnp.zeros((b, chunk), jnp.float32))
        t, token, cache, done, ids, logps = self._loop(params, state, jnp.minimum(t + chunk, max_new), p=p, key=key,
                                                       lengths=lengths, key_valid=key_valid, decode=decode)
        return ids, logps, t, token, cache, done

    def __call__(self, params: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 eos_id: int | Sequence[int] | None = None, seed: int = 0,
                 on_step: Callable[[np.ndarray], None] | None = None, keep_stop: bool = False,
                 group: int = 1, draw: str = "cdf") -> Generation:
        """Generate continuations of ``prompts`` (token ids): the new ids per prompt (the stop id excluded, unless
        ``keep_stop``) and each one's log-prob under the tempered distribution it was sampled from.

        ``params``: the model's params, or (adapters, base) for LoRA (merged first, with ``merged``). ``eos_id``: one
        or several stop ids. on_step(tokens (B,)) is called after each generated position, for streaming.
        ``group``: the prompts come in runs of ``group`` equal ones (GRPO's completions of a prompt): each run is
        prefilled once (the same tokens as prefilling every row: the rows' logits are equal, the draws are per row).
        ``draw``: how a token is drawn (`DRAWS`).
        """
        if self.plain is not None and isinstance(params, (tuple, list)):  # LoRA: merged into a temporary copy
            return self.plain(merged_weights(params[0], params[1], self.lora), prompts, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, seed=seed,
                              on_step=on_step, keep_stop=keep_stop, group=group, draw=draw)
        max_new_tokens = check_prompts(prompts, self.max_seq_len, max_new_tokens)
        group = 1 if on_step is not None else _checked_group(prompts, group)
        block = Prompts.left_padded(prompts, group, max_new_tokens, self.max_seq_len)
        sampling, stops, key = Sampling.of(temperature, top_k, top_p, draw), stop_tuple(eos_id), jax.random.key(seed)
        if on_step is None:
            decode = Decode(sampling, stops, block.cache_len, max_new_tokens, group)
            return self._batch(params, prompts, block, key, decode, keep_stop)
        return self._stream(params, prompts, block, key, Decode(sampling, stops, chunk=STREAM_CHUNK), max_new_tokens,
                            on_step, keep_stop)

    def open(self, params: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | Sequence[int] | None = None,
             seed: int = 0, group: int = 1, draw: str = "cdf") -> tuple[Generation, Session]:
        """A batch generation like ``__call__`` (stop ids kept), and the `Session` that continues its rows with more
        tokens (tool results) without computing what came before again."""
        if self.plain is not None and isinstance(params, (tuple, list)):  # LoRA: merged once for every turn
            return self.plain.open(merged_weights(params[0], params[1], self.lora), prompts,
                                   max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                   eos_id=eos_id, seed=seed, group=group, draw=draw)
        max_new_tokens = check_prompts(prompts, self.max_seq_len, max_new_tokens)
        group = _checked_group(prompts, group)
        block = Prompts.left_padded(prompts, group, max_new_tokens, self.max_seq_len)
        sampling, stops, key = Sampling.of(temperature, top_k, top_p, draw), stop_tuple(eos_id), jax.random.key(seed)
        decode = Decode(sampling, stops, block.cache_len, max_new_tokens, group, keep_cache=True)
        packed = pack_prompts(prompts, block.tokens.shape[1]) if group == 1 and self.pack else None
        ids, logps, n, cache = self._generate(params, block.tokens, block.valid, key, block.lengths, packed,
                                              decode=decode)
        p = block.tokens.shape[1]
        key_valid = np.concatenate([np.repeat(block.valid, group, axis=0),
                                    np.ones((len(prompts), block.cache_len - p), bool)], axis=1)
        session = Session(self, params, cache, key_valid, p, block.lengths.astype(np.int64) - 1,
                          np.zeros(len(prompts), np.int32), Decode(sampling, stops, max_new=max_new_tokens))
        return session.taken(host(ids), host(logps), int(host(n)), range(len(prompts))), session

    def _batch(self, params, prompts, block: Prompts, key, decode: Decode, keep_stop: bool) -> Generation:
        """Batch generation: one program, the host reading its tokens and log-probs once, at the end."""
        packed = pack_prompts(prompts, block.tokens.shape[1]) if decode.group == 1 and self.pack else None
        # host(): every process of a multi-host run gets the whole (replicated) result
        ids, logps, n = (host(x) for x in self._generate(params, block.tokens, block.valid, key, block.lengths,
                                                         packed, decode=decode))
        ends = []
        for row in ids[:, :int(n)]:
            hit = np.flatnonzero(np.isin(row, decode.stops)) if decode.stops else []
            ends.append(len(row) if not len(hit) else int(hit[0]) + (1 if keep_stop else 0))
        return Generation([row[:end].tolist() for row, end in zip(ids, ends)],
                          [row[:end].tolist() for row, end in zip(logps, ends)])

    def _stream(self, params, prompts, block: Prompts, key, decode: Decode, max_new_tokens: int,
                on_step: Callable[[np.ndarray], None], keep_stop: bool) -> Generation:
        """Streaming: the prefill, then chunks of ``decode.chunk`` positions, each one program on device; the host
        hands each chunk's tokens to ``on_step`` one position at a time."""
        p_len = block.tokens.shape[1]
        nxt, first, cache, key_valid = self._prefill(params, block.tokens, block.valid, key,
                                                     decode=Decode(decode.sampling, cache_len=block.cache_len))
        out, done, drawn = [[] for _ in prompts], np.zeros(len(prompts), bool), [np.asarray(first)]
        finished = collect(np.asarray(nxt), out, done, decode.stops, on_step, keep_stop)
        t, stopped = 1, jnp.asarray(done)
        while not finished and t < max_new_tokens:
            ids, logps, t_next, nxt, cache, stopped = self._chunk(
                params, cache, key_valid, nxt, jnp.int32(p_len), jnp.int32(t), jnp.int32(max_new_tokens), key,
                jnp.asarray(block.lengths), stopped, decode=decode)
            ids, logps, t_next = np.asarray(ids), np.asarray(logps), int(t_next)
            for pos in range(t, t_next):
                drawn.append(logps[:, pos % decode.chunk])
                if collect(ids[:, pos % decode.chunk], out, done, decode.stops, on_step, keep_stop):
                    finished = True
                    break
            t = t_next
        return Generation(out, row_logps(drawn, out))


@dataclasses.dataclass
class Session:
    """A batch generation kept open for more turns (`Generator.open`): every row's KV cache on device, and on the
    host which cache slots hold its real tokens (``key_valid``, (B, S)), the first slot no turn has written
    (``slot``), each row's last token and its position. `extend` appends tokens (a tool's result) to some rows and
    generates their next turn: only the appended tokens are computed, the rest is read from the cache.

    Slots are shared by the rows: a turn writes from ``slot`` on for every row, each row's tokens right-aligned in
    the appended block, and the slots a row did not fill (its padding, what it generated after its stop) are marked
    invalid. A row's last token (its stop) is written again at the start of its next block, so a turn never
    depends on whether the decode loop fed it. Positions are each row's own count, so the model computes what it
    would on the whole conversation in one row (tested against prefilling it again).

    A row left out of a turn is done (a rollout that answered): no later turn continues it. When a turn's rows fit
    a power-of-two bucket (at least 8) smaller than the batch, the session keeps those rows only (their cache
    gathered once), so later turns compute for the rollouts still going and not for the whole first batch."""

    generator: Generator
    params: Any
    cache: Any
    key_valid: np.ndarray
    slot: int
    positions: np.ndarray  # (B,) the position of each row's last token
    last: np.ndarray  # (B,) each row's last token
    decode: Decode  # the sampling and the stops (shapes set per call)
    index: np.ndarray | None = None  # (first batch's rows,) each row's place in the batch now; -1: done

    def __post_init__(self):
        if self.index is None:
            self.index = np.arange(len(self.last))

    def taken(self, ids: np.ndarray, logps: np.ndarray, n: int, rows: Sequence[int], start: int | None = None,
              ) -> Generation:
        """The rows' tokens of a turn generated from slot ``start`` (default: ``slot``, a first turn's prompt end),
        each up to its stop (kept); records each row's last token and position, and invalidates the slots after
        its last one."""
        start = self.slot if start is None else start
        out, out_logps = [], []
        for j, row in enumerate(ids[:, :n]):
            hit = np.flatnonzero(np.isin(row, self.decode.stops)) if self.decode.stops else []
            end = n if not len(hit) else int(hit[0]) + 1
            out.append(row[:end].tolist())
            out_logps.append(logps[j, :end].tolist())
        for j, i in enumerate(rows):
            self.last[i] = out[j][-1]
            self.positions[i] += len(out[j])
            self.key_valid[i, start + len(out[j]) - 1:start + n - 1] = False  # its stop (written again) and after
        self.slot = start + n - 1
        return Generation(out, out_logps)

    def extend(self, rows: Sequence[int], appended: Sequence[Sequence[int]], *, max_new_tokens: int,
               seed: int) -> Generation:
        """The next turn of ``rows`` (the others left alone), after each one's ``appended`` tokens; at most
        ``max_new_tokens`` new ones each, stop ids kept. ``rows`` are the first batch's; the others are done."""
        rows = self._narrowed(rows)  # from here on, places in the batch
        b = len(self.last)
        blocks = [[int(self.last[i]), *a] for i, a in zip(rows, appended)]
        c = bucket(max(map(len, blocks)), minimum=8)
        tokens, positions = np.zeros((b, c), np.int32), np.zeros((b, c), np.int32)
        written = np.zeros((b, c), bool)
        for i, block in zip(rows, blocks):
            tokens[i, c - len(block):] = block
            positions[i, c - len(block):] = self.positions[i] + np.arange(len(block))
            written[i, c - len(block):] = True
        need = self.slot + c + max_new_tokens
        if need > self.key_valid.shape[1]:  # a cache bucket more: its slots empty, and valid until written
            slots = bucket(need)
            self.cache = self.generator._grown(self.cache, slots=slots)
            self.key_valid = np.concatenate([self.key_valid, np.ones((b, slots - self.key_valid.shape[1]), bool)], 1)
        self.key_valid[:, self.slot:self.slot + c] = written
        done = np.ones(b, bool)
        done[list(rows)] = False
        lengths = np.array([self.positions[i] + (len(blocks[rows.index(i)]) if i in rows else 0)
                            for i in range(b)], np.int32)
        for i, block in zip(rows, blocks):
            self.positions[i] += len(block) - 1  # its appended block's last token; the turn's ids are counted next
        decode = dataclasses.replace(self.decode, max_new=max_new_tokens)
        ids, logps, n, self.cache = self.generator._extend(
            self.params, self.cache, self.key_valid, tokens, positions, jnp.int32(self.slot), jax.random.key(seed),
            lengths, done, decode=decode)
        ids, logps = host(ids), host(logps)
        return self.taken(ids[rows], logps[rows], int(host(n)), rows, start=self.slot + c)

    def _narrowed(self, rows: Sequence[int]) -> list[int]:
        """The places of ``rows`` (the first batch's) in the batch, the other rows marked done; the batch first
        cut to those rows (padded to their bucket by repeating the first, which stays done) when that bucket is
        smaller."""
        at = self.index[list(rows)]
        if (at < 0).any():
            raise ValueError(f"Session.extend: rows {[r for r, a in zip(rows, at) if a < 0]} were left out of an "
                             f"earlier turn, so they are done; a turn continues rows of the turn before only")
        self.index[:] = -1
        width = bucket(len(rows), minimum=min(8, len(self.last)))
        if width >= len(self.last):
            self.index[list(rows)] = at
            return at.tolist()
        keep = np.concatenate([at, np.full(width - len(at), at[0])])
        self.cache = self.generator._rows(self.cache, jnp.asarray(keep, jnp.int32))
        self.key_valid, self.positions, self.last = self.key_valid[keep], self.positions[keep], self.last[keep]
        self.index[list(rows)] = np.arange(len(rows))
        return list(range(len(rows)))


def _checked_group(prompts: Sequence[Sequence[int]], group: int) -> int:
    """``group``, once the prompts are seen to come in runs of ``group`` equal ones (a `ValueError` otherwise)."""
    if group <= 1:
        return 1
    if len(prompts) % group or any(list(p) != list(prompts[i - i % group]) for i, p in enumerate(prompts)):
        raise ValueError(f"generate: group={group} needs the prompts in runs of {group} equal ones")
    return group
