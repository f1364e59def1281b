"""TPU attention kernels: JAX's own Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`),
selected by ``model.attention: splash``.

The kernel computes causal attention block by block in the chip's fast memory and never holds a (T, T) score matrix:
memory linear in the sequence, and the blocks that a causal, packed or sliding-window mask rules out entirely are
skipped. It takes the mask as structure (`BlockMask`: causal, within each packed sequence, within a window), not
as a dense array, so the forwards that need a dense or region mask (the sampler's KV cache, GRPO's rows in
regions, padded keys) keep the XLA path, as do lengths that the kernel's 128-position tiles do not divide.

Under a mesh the kernel runs per device (`jax.shard_map`): rows split over the batch axes, heads over ``tensor``.
A training run that asks for it on another platform is refused when it starts (`jaxtune.loop`); elsewhere (a TPU
run's evaluation or export on a CPU host) the XLA path computes the same attention. The tests run the kernel on CPU
in Pallas's interpret mode (`interpreted`) against the XLA path, and ``info --compile-for`` compiles the real kernel
for the slice's chips.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from jaxtune import sharding

TILE = 128  # the kernel's smallest block along either sequence (the TPU's lane width)


class BlockMask(NamedTuple):
    """What a kernel needs to know of a training forward's mask: causal always; within each packed sequence
    (``segment_ids`` (B, T); None: one sequence a row); within ``window`` (query - key < window; None: no limit)."""

    segment_ids: jax.Array | None
    window: int | None


_interpret: contextvars.ContextVar[bool] = contextvars.ContextVar("splash_interpret", default=False)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Run the kernel on any platform, in Pallas's interpret mode (the tests' check against the XLA path on CPU)."""
    token = _interpret.set(True)
    try:
        yield
    finally:
        _interpret.reset(token)


def _platform() -> str:
    """The platform being traced for: the active mesh's devices' (a TPU slice planned on a CPU host), else JAX's."""
    active = sharding.active_mesh()
    return active.devices.flat[0].platform if active is not None else jax.default_backend()


def kernel_takes(t: int) -> bool:
    """Whether sequences of ``t`` positions go through the kernel: on TPU (or `interpreted`), its tiles dividing
    them. Elsewhere the XLA path computes the same attention (a TPU run's held-out evaluation on a CPU host)."""
    return t % TILE == 0 and (_platform() == "tpu" or _interpret.get())


def _block(t: int) -> int:
    return 512 if t % 512 == 0 else TILE


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: BlockMask, scale: float,
                     softcap: float | None) -> jax.Array:
    """Attention of (B, T, N, H) queries over (B, T, K, H) keys and values (K divides N) under ``mask``, through the
    splash kernel, the same math as `jaxtune.models.layers.attention`'s XLA path."""
    active, interpret = sharding.active_mesh(), _platform() != "tpu"
    window = mask.window

    def local(q, k, v, seg):
        _, t, n, _ = q.shape
        base = sm.CausalMask((t, t)) if window is None else sm.LocalMask((t, t), (window - 1, 0), 0)
        blk = _block(t)
        blocks = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                               block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
        kernel = sk.make_splash_mha(sm.MultiHeadMask([base] * n), block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                    attn_logits_soft_cap=softcap, interpret=interpret)
        heads_first = lambda x: x.transpose(0, 2, 1, 3)  # (B, T, N, H) -> (B, N, T, H)

        def row(q, k, v, s):
            return kernel(q, k, v, segment_ids=None if s is None else sk.SegmentIds(s, s))

        if seg is None:
            out = jax.vmap(lambda q, k, v: row(q, k, v, None))(heads_first(q * np.asarray(scale, q.dtype)),
                                                               heads_first(k), heads_first(v))
        else:
            out = jax.vmap(row)(heads_first(q * np.asarray(scale, q.dtype)), heads_first(k), heads_first(v), seg)
        return heads_first(out)

    seg = mask.segment_ids
    if active is None:
        return local(q, k, v, seg)
    qkv = sharding.spec(("batch", None, "act_heads", None), active)
    kv = sharding.spec(("batch", None, "act_kv_heads", None), active)
    if seg is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=active, in_specs=(qkv, kv, kv),
                             out_specs=qkv, check_vma=False)(q, k, v)
    rows = sharding.spec(("batch", None), active)
    return jax.shard_map(local, mesh=active, in_specs=(qkv, kv, kv, rows), out_specs=qkv, check_vma=False)(
        q, k, v, seg)
