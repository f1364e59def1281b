"""QLoRA's frozen base: the adapted projections' kernels stored quantized, dequantized per matmul.

``model.quantize`` (with LoRA): every kernel that carries adapters (``model.lora.targets``) is kept on the device as
a `qwix.QArray` (qwix, the JAX stack's quantization library): its values in the chosen type (``nf4``: the 16
NormalFloat levels of QLoRA in 4 bits; ``int8``; ``int4``) and one float32 absmax scale per block of `BLOCK`
consecutive inputs of each output (QLoRA's 64-element blocks, along the input axis; a kernel whose inputs 64 does not
divide takes the largest block below that does, at least 16). `jaxtune.models.layers.Dense`
dequantizes its kernel inside the jitted forward, in the compute dtype, right where the matmul reads it; the adapters
and the optimizer state stay in float32. Everything else of the base (embeddings, norms, the output layer, kernels
without adapters) keeps ``model.param_dtype``.

``model.quantize: gguf`` keeps a ``.gguf`` file's own blocks instead (`jaxtune.models.gguf_blocks`): a kernel is a
`GGUFBlocks`, integer values with a float32 scale and, for llama.cpp's asymmetric types, a float32 offset per block.
`is_quantized` and `dequantize` take both kinds, so the layers, the merge and the memory count need nothing more.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxtune.config import ConfigError

BLOCK = 64  # inputs per scale, as QLoRA's NF4 blocks
MIN_BLOCK = 16  # the finest block a kernel whose inputs 64 does not divide may fall back to
QTYPES: dict[str, Any] = {"nf4": "nf4", "int8": jnp.int8, "int4": jnp.int4}


@struct.dataclass
class GGUFBlocks:
    """A kernel as llama.cpp quantized it: ``x = scale * qvalue + offset``, one scale (and offset) per block of
    consecutive inputs of one output. ``qvalue`` (..., in, out) integers (int4, uint4 or int8); ``scale`` and
    ``offset`` (..., in / block, out) float32; ``offset`` None where every block is symmetric."""

    qvalue: jax.Array
    scale: jax.Array
    offset: jax.Array | None = None

    shape = property(lambda self: self.qvalue.shape)
    ndim = property(lambda self: self.qvalue.ndim)
    dtype = property(lambda self: self.scale.dtype)

    def dequantize(self) -> jax.Array:
        """float32 values: each value times its block's scale, plus its offset (the order llama.cpp's reference
        dequantizers compute in, so equal to them in float32)."""
        *lead, n_in, out = self.qvalue.shape
        blocks = self.scale.shape[-2]
        v = self.qvalue.astype(jnp.float32).reshape(*lead, blocks, n_in // blocks, out)
        w = v * self.scale[..., :, None, :]
        if self.offset is not None:
            w = w + self.offset[..., :, None, :]
        return w.reshape(*lead, n_in, out)


def is_quantized(x: Any) -> bool:
    return isinstance(x, (qwix.QArray, GGUFBlocks))


def logical_size(tree: Any) -> int:
    """The parameters in ``tree`` (arrays or their abstract shapes), a quantized kernel counted as the weights it
    stands for (its logical shape), not as its stored values plus their scales and offsets."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree, is_leaf=is_quantized))


def block_size(inputs: int, kind: str) -> int:
    """The block of a kernel with ``inputs`` inputs: `BLOCK`, or where it does not divide them the largest size
    below it that does (96 inputs: 48), down to `MIN_BLOCK` (a finer block is more accurate, its scales a larger
    share of the bytes); a `ConfigError` below that."""
    size = next(b for b in range(min(BLOCK, inputs), 0, -1) if inputs % b == 0)
    if size < MIN_BLOCK:
        raise ConfigError(f"model.quantize={kind}: a kernel of {inputs} inputs splits into no block of "
                          f"{MIN_BLOCK} to {BLOCK} inputs; quantize a model whose widths are multiples of 16, or drop "
                          "model.quantize")
    return size


def quantize_kernel(w: jax.Array, kind: str) -> qwix.QArray:
    """``w`` (in, out), or (layers, in, out) stacked, in blocks of `block_size` inputs per output (per layer)."""
    lead = w.ndim - 2
    tiles = {**{i: 1 for i in range(lead)}, lead: block_size(w.shape[-2], kind), lead + 1: 1}
    return qwix.quantize(w, QTYPES[kind], tiled_axes=tiles)


def dequantize(x: Any, dtype: Any = None) -> jax.Array:
    """A kernel as an array: a QArray dequantized (in ``dtype``, default its scale's float32), else as it is."""
    if not is_quantized(x):
        return x if dtype is None else x.astype(dtype)
    w = x.dequantize() if isinstance(x, GGUFBlocks) else qwix.dequantize(x)
    return w if dtype is None else w.astype(dtype)


def _adapted(adapters: Any, base: Any, fn) -> Any:
    """``base`` (a pure dict) with ``fn`` applied to the kernel of every node that has adapters in ``adapters``."""
    if isinstance(adapters, dict) and "lora_a" in adapters:
        return {**base, "kernel": fn(base["kernel"])}
    if isinstance(adapters, dict):
        return {k: _adapted(adapters[k], v, fn) if k in adapters else v for k, v in base.items()}
    return base


def quantize_base(adapters: Any, base: Any, kind: str) -> Any:
    """The frozen base with the adapted kernels quantized (``adapters``: the adapters tree, or its abstract)."""
    return _adapted(adapters, base, lambda w: quantize_kernel(w, kind))


def dequantize_base(base: Any, dtype: Any = None) -> Any:
    """A base with every quantized kernel dequantized (to ``dtype``): for exports and merges."""
    return jax.tree.map(lambda x: dequantize(x, dtype), base, is_leaf=is_quantized)


def quantized_layout(adapters: Any, abstract: Any, shardings: Any, kind: str) -> tuple[Any, Any]:
    """(abstract, shardings) of the quantized base: a quantized kernel's values placed as the kernel was, its scales
    (blocks, out) sharded along the outputs only (a count of blocks need not divide by a mesh axis)."""
    quantized = jax.eval_shape(lambda b: quantize_base(adapters, b, kind), abstract)

    def place(kernel_sharding: NamedSharding, q: Any) -> Any:
        if not is_quantized(q):
            return kernel_sharding
        spec = tuple(kernel_sharding.spec) + (None,) * (q.qvalue.ndim - len(kernel_sharding.spec))
        scale = NamedSharding(kernel_sharding.mesh, PartitionSpec(*spec[:-2], None, spec[-1]))
        return q.replace(qvalue=kernel_sharding, scale=scale)

    placed = jax.tree.map(place, shardings, quantized, is_leaf=lambda x: isinstance(x, NamedSharding))
    with_shardings = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), quantized, placed)
    return with_shardings, placed


def streaming_quantizer(quantized_abstract: Any, quantized_shardings: Any, kind: str):
    """``transform(path, array)`` for `jaxtune.models.hf.load_params`: each kernel the quantized layout holds as a
    QArray is quantized as soon as it is read (its float copy then let go), every other leaf kept as read; so the
    float base is never on the device whole, only one kernel of it at a time."""
    layout = dict(jax.tree_util.tree_flatten_with_path(quantized_abstract, is_leaf=is_quantized)[0])
    placed = dict(jax.tree_util.tree_flatten_with_path(quantized_shardings, is_leaf=is_quantized)[0])
    programs: dict[Any, Any] = {}

    def transform(path: tuple, array: jax.Array) -> Any:
        if not is_quantized(layout.get(path)):
            return array
        key = (array.shape, array.dtype, array.sharding, jax.tree.leaves(placed[path]) and str(placed[path]))
        if key not in programs:  # one program per kernel shape and layout (q and o share one, k and v another...)
            programs[key] = jax.jit(lambda w: quantize_kernel(w, kind), out_shardings=placed[path],
                                    donate_argnums=0)
        return programs[key](array)

    return transform
