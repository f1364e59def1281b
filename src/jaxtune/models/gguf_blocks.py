"""``model.quantize: gguf``: QLoRA on a ``.gguf`` file's own quantized blocks.

The frozen base's adapted kernels (``model.lora.targets``) stay on the device as the file quantized them, as
`jaxtune.models.quantize.GGUFBlocks`: the integer values and the per-block scales (and, for the asymmetric types,
offsets) decoded from llama.cpp's bit layouts, never dequantized and quantized again, so the model computes with
exactly the weights llama.cpp computes with. Everything else of the base (embeddings, norms, the output layer,
kernels without adapters) is read from the file's converted directory as without ``model.quantize``.

Types that map (`FORMATS`), as ``x = scale * value + offset`` per block of inputs of one output:
  Q8_0  int8 value, one fp16 scale per 32                    Q4_0  q - 8 (int4), scale d, blocks of 32
  Q5_0  q - 16 (int8), scale d, blocks of 32                 Q6_K  q - 32 (int8), scale d * sc, blocks of 16
  Q4_1  q (uint4), scale d, offset m, blocks of 32           Q5_1  q (int8), scale d, offset m, blocks of 32
  Q4_K  q (uint4), scale d * sc, offset -dmin * m, 32        Q5_K  q (int8), as Q4_K
Every product ``scale * value`` is exact in float32 (at most 24 significant bits), and the one addition of an
offset rounds as the reference's does: the decoded weights equal the ``gguf`` package's dequantized ones.

A kernel is one array over the layers when they are stacked (``model.scan_layers``), and a Q4_K_M file mixes
types across layers (llama.cpp gives some layers' attn_v and ffn_down Q6_K, others Q4_K; a kernel whose inputs 256
does not divide falls back to Q5_0 or Q8_0). So each kernel takes one common form, known from the file's header
before anything is read (the memory plan needs it): values uint4 where every layer's are 0..15, int4 where they
are -8..7, else int8; the finest block of its layers (a coarser layer's scales repeated, exact); an offset where any
layer is asymmetric (zeros in the others).
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxtune.config import ConfigError
from jaxtune.io import CheckpointError
from jaxtune.models.gguf import ARCHITECTURES, _gguf, tensor_names, unpermute
from jaxtune.models.hf import match_param
from jaxtune.models.quantize import GGUFBlocks
from jaxtune.models.wheels import is_wheel_ref, wheel_file

QK_K = 256  # a K-quant super-block
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # values (n, size) int, scale and offset (n, size/block)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row as one float16, in float32: (n, 2) uint8 -> (n, 1)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Packed 4-bit values: each run of ``width`` bytes holds ``width`` values in its low nibbles, then ``width``
    more in its high ones. (n, k * width) uint8 -> (n, 2 * k * width)."""
    n = len(qs)
    return ((qs.reshape(n, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(n, -1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each little-endian uint32 of ``qh`` (n, 4) uint8, for i < ``count``: (n, count)."""
    word = np.ascontiguousarray(qh).view("<u4").astype(np.uint32)
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks: bytes 0-3 hold scales 0-3 (low 6 bits)
    and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scale (low
    nibble) and min (high nibble) 4-7."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b: np.ndarray) -> Decoded:
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 2:], 16).astype(np.int8) - 8, _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 4:], 16).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6], 32) << 4)
    return q.astype(np.int8) - 16, _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 8:], 16) | (_bits(b[:, 4:8], 32) << 4)
    return q.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q4_k(b: np.ndarray) -> Decoded:
    sc, mn = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:], 32).astype(np.int8), _f16(b[:, :2]) * sc, -(_f16(b[:, 2:4]) * mn)


def _q5_k(b: np.ndarray) -> Decoded:
    n = len(b)
    sc, mn = _k_scales(b[:, 4:16])
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # sub-block j: bit j
    q = _nibbles(b[:, 48:], 32) | (high.reshape(n, QK_K) << 4)
    return q.astype(np.int8), _f16(b[:, :2]) * sc, -(_f16(b[:, 2:4]) * mn)


def _q6_k(b: np.ndarray) -> Decoded:
    n = len(b)
    low = _nibbles(b[:, :128], 64)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = low | (high.reshape(n, QK_K) << 4)
    return q.astype(np.int8) - 32, _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32), None


@dataclass(frozen=True)
class Format:
    """How one GGUF type maps: inputs per scale, the range of its values, whether it has offsets, its decoder
    (raw blocks (n, bytes) -> `Decoded`)."""

    block: int
    lo: int
    hi: int
    offset: bool
    decode: Callable[[np.ndarray], Decoded]


FORMATS = {"Q4_0": Format(32, -8, 7, False, _q4_0), "Q4_1": Format(32, 0, 15, True, _q4_1),
           "Q5_0": Format(32, -16, 15, False, _q5_0), "Q5_1": Format(32, 0, 31, True, _q5_1),
           "Q8_0": Format(32, -128, 127, False, _q8_0), "Q4_K": Format(32, 0, 15, True, _q4_k),
           "Q5_K": Format(32, 0, 31, True, _q5_k), "Q6_K": Format(16, -32, 31, False, _q6_k)}


def decode(data: np.ndarray, type_name: str) -> Decoded:
    """A quantized GGUF tensor's raw bytes (rows, bytes per row) as (values (rows, inputs) int8, scale and offset
    (rows, inputs / block) float32 (offset None for a symmetric type)), blocks along the inputs."""
    gguf = _gguf()
    f = FORMATS[type_name]
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rows = data.shape[0]
    v, s, o = f.decode(np.asarray(data, np.uint8).reshape(-1, type_size))
    return (v.reshape(rows, -1), s.reshape(rows, -1),
            None if o is None else o.reshape(rows, -1))


# --- the file's header, read without its vocabulary (gguf.GGUFReader decodes every token: seconds for 262k) ---

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order, (out, in) for a linear layer
    offset: int  # of its data, from the file's start
    nbytes: int


class _Cursor:
    """Reads a GGUF header's little-endian fields in order from ``buf``, from byte ``pos`` on."""

    def __init__(self, buf: Any, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", "replace")

    def skip(self, kind: int, count: int) -> None:
        """Past ``count`` values of type ``kind`` (strings and arrays of any depth included), decoding none."""
        if kind == _STRING:
            for _ in range(count):
                n = self.take("Q")  # before the +=: `self.pos += self.take(...)` would add to the pos read first
                self.pos += n
        elif kind == _ARRAY:
            for _ in range(count):
                sub = self.take("I")
                self.skip(sub, self.take("Q"))
        else:
            self.pos += struct.calcsize("<" + _SCALAR[kind]) * count


def _metadata(cursor: _Cursor, n_kv: int) -> dict[str, Any]:
    """The ``n_kv`` metadata entries at the cursor: scalars and strings by key; arrays skipped."""
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, kind = cursor.string(), cursor.take("I")
        if kind == _STRING:
            meta[key] = cursor.string()
        elif kind == _ARRAY:
            sub = cursor.take("I")
            cursor.skip(sub, cursor.take("Q"))
        else:
            meta[key] = cursor.take(_SCALAR[kind])
    return meta


def _tensor_entries(cursor: _Cursor, n_tensors: int) -> list[tuple[str, list[int], int, int]]:
    """The ``n_tensors`` tensor entries at the cursor: (name, dims as GGUF lists them, ggml type, offset in the data
    section)."""
    entries = []
    for _ in range(n_tensors):
        name, n_dims = cursor.string(), cursor.take("I")
        dims = [cursor.take("Q") for _ in range(n_dims)]
        entries.append((name, dims, cursor.take("I"), cursor.take("Q")))
    return entries


def _tensor_info(name: str, dims: list[int], kind: int, offset: int, data_start: int) -> TensorInfo:
    """One tensor entry as a `TensorInfo`: its shape row-major, where its bytes start in the file and how many."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType(kind)
    size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(int(d) for d in reversed(dims))
    nbytes = math.prod(shape[:-1]) * shape[-1] // size * type_size
    return TensorInfo(name, qtype.name, shape, data_start + offset, nbytes)


def read_header(file: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(scalar and string metadata, tensors by name) of a GGUF file (version 2 or 3, little-endian); arrays in the
    metadata are skipped, not decoded."""
    _gguf()  # the package that names the tensor types: missing, an error before the file is read
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if bytes(buf[:4]) != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
            raise CheckpointError(f"{file}: not a little-endian GGUF file of version 2 or 3")
        cursor = _Cursor(buf, 8)
        n_tensors, n_kv = cursor.take("Q"), cursor.take("Q")
        meta = _metadata(cursor, n_kv)
        entries = _tensor_entries(cursor, n_tensors)
        align = int(meta.get("general.alignment", 32))
        data_start = -(-cursor.pos // align) * align
    return meta, {name: _tensor_info(name, dims, kind, offset, data_start) for name, dims, kind, offset in entries}


def raw_rows(file: Path, t: TensorInfo) -> np.ndarray:
    """A tensor's bytes, (rows, bytes per row), memory-mapped."""
    data = np.memmap(file, np.uint8, "r", offset=t.offset, shape=(t.nbytes,))
    return data.reshape(math.prod(t.shape[:-1]), -1)


@dataclass(frozen=True)
class Common:
    """One kernel's form over its layers: values dtype, inputs per block, whether it has offsets."""

    dtype: Any
    block: int
    offset: bool


def common_form(types: list[str]) -> Common:
    fs = [FORMATS[t] for t in types]
    lo, hi = min(f.lo for f in fs), max(f.hi for f in fs)
    dtype = ml_dtypes.uint4 if lo >= 0 and hi <= 15 else ml_dtypes.int4 if lo >= -8 and hi <= 7 else np.int8
    return Common(np.dtype(dtype), math.gcd(*(f.block for f in fs)), any(f.offset for f in fs))


@dataclass(frozen=True)
class Plan:
    """Where each adapted kernel (a path of the base's pure dict) comes from: per layer (one, or the stack's), the
    GGUF tensor and the head count of its rows' llama.cpp permutation (0: none); and its `Common` form."""

    path: Path
    kernels: dict[tuple, tuple[list[tuple[str, int]], Common]]
    hf_names: frozenset[str]  # the converted directory's tensors these kernels replace (never read from it)


def gguf_file(from_hf: str | None) -> Path:
    """The ``.gguf`` file ``model.from_hf`` names (a path, or ``wheel:NAME``); the config checks it is one."""
    name = str(from_hf)
    return wheel_file(name) if is_wheel_ref(name) else Path(name).expanduser()


class Without:
    """A checkpoint (`jaxtune.models.hf.HFCheckpoint`) without the tensors ``names``: what `load_params` reads the
    rest of the base from (the kernels kept as blocks are neither read nor reported unused)."""

    def __init__(self, ckpt: Any, names: frozenset[str]):
        self.ckpt, self.skip, self.dir, self.config = ckpt, names, ckpt.dir, ckpt.config

    def names(self) -> set[str]:
        return self.ckpt.names() - self.skip

    def get(self, name: str) -> np.ndarray:
        return self.ckpt.get(name)


def _keys(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _adapted_paths(adapters: Any, base: Any) -> list[tuple]:
    """The paths (jax key paths) of the base's kernels that carry adapters."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(base)[0]:
        node = adapters
        for k in path[:-1]:
            node = node.get(k.key) if isinstance(node, dict) else None
        if getattr(path[-1], "key", None) == "kernel" and isinstance(node, dict) and "lora_a" in node:
            out.append(path)
    return out


def plan(file: Path, fam: Any, model_cfg: Any, adapters: Any, base: Any) -> Plan:
    """The `Plan` of ``file`` for the base abstract ``base`` (a pure dict) of a run with ``adapters``, from the
    file's header (its tensors' names, types and shapes; nothing is read). A type with no map is a ConfigError."""
    where = str(file)
    meta, tensors = read_header(file)
    arch = str(meta.get("general.architecture"))
    permuted = ARCHITECTURES.get(arch, ("", "", False))[2]
    to_gguf = {hf: g for g, hf in tensor_names(arch).items()}
    kernels, hf_names = {}, set()
    for path in _adapted_paths(adapters, base):
        m, layer = match_param(fam, _keys(path))
        leaf = base
        for k in path:
            leaf = leaf[k.key]
        layers = range(leaf.shape[0]) if layer == "stacked" else [layer]
        stem, suffix = m.hf.removesuffix(".weight"), ".weight"
        template = to_gguf.get(stem, stem)
        sources, types = [], []
        for i in layers:
            hf_names.add(m.hf.format(i=i))
            name = template.format(i=i) + suffix
            t = tensors.get(name)
            if t is None:
                raise CheckpointError(f"{where}: model.quantize=gguf finds no tensor {name} for the adapted kernel "
                                      f"{m.hf.format(i=i)}")
            kind = t.type_name
            if kind not in FORMATS:
                raise ConfigError(
                    f"model.quantize=gguf: {where}: tensor {name} is {kind}, which has no map to blocks on the device "
                    f"(mapped: {', '.join(FORMATS)}); use model.quantize=nf4, int8 or int4 (they quantize the "
                    "file's dequantized weights again), or a file quantized to one of the mapped types (Q4_K_M, "
                    "Q8_0, ...)")
            out, inputs = t.shape
            if (inputs, out) != tuple(leaf.shape[-2:]):
                raise CheckpointError(f"{where}: tensor {name} is ({out}, {inputs}), the model's kernel "
                                      f"{tuple(leaf.shape[-2:])[::-1]} (out, in)")
            heads = 0
            if permuted and name.endswith(".attn_q.weight"):
                heads = model_cfg.n_head
            elif permuted and name.endswith(".attn_k.weight"):
                heads = model_cfg.n_kv_head or model_cfg.n_head
            sources.append((name, heads))
            types.append(kind)
        kernels[path] = (sources, common_form(types))
    return Plan(file, kernels, frozenset(hf_names))


def layout(p: Plan, base: Any, shardings: Any) -> tuple[Any, Any]:
    """(abstract, shardings) of the base with each planned kernel a `GGUFBlocks`: its values placed as the kernel
    was, its scales and offsets (blocks, out) sharded along the outputs only."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(base)
    sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    abstract, placed = [], []
    for (path, a), s in zip(flat, sh, strict=True):
        if path not in p.kernels:
            abstract.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s))
            placed.append(s)
            continue
        form = p.kernels[path][1]
        spec = tuple(s.spec) + (None,) * (len(a.shape) - len(s.spec))
        blocks_sh = NamedSharding(s.mesh, PartitionSpec(*spec[:-2], None, spec[-1]))
        blocks = (*a.shape[:-2], a.shape[-2] // form.block, a.shape[-1])
        scale = jax.ShapeDtypeStruct(blocks, np.float32, sharding=blocks_sh)
        abstract.append(GGUFBlocks(jax.ShapeDtypeStruct(a.shape, form.dtype, sharding=s), scale,
                                   scale if form.offset else None))
        placed.append(GGUFBlocks(s, blocks_sh, blocks_sh if form.offset else None))
    return jax.tree_util.tree_unflatten(treedef, abstract), jax.tree_util.tree_unflatten(treedef, placed)


def read_kernel(file: Path, tensors: dict[str, TensorInfo], sources: list[tuple[str, int]],
                form: Common) -> tuple[np.ndarray, ...]:
    """One kernel's (values, scale[, offset]) in its common form, (layers, in, out) when ``sources`` are a stack's,
    read tensor by tensor from the file's memory map."""
    per_layer = []
    for name, heads in sources:
        t = tensors[name]
        v, s, o = decode(raw_rows(file, t), t.type_name)
        repeat = FORMATS[t.type_name].block // form.block
        s = np.repeat(s, repeat, axis=1)
        o = np.zeros_like(s) if o is None and form.offset else None if o is None else np.repeat(o, repeat, axis=1)
        parts = [v.astype(form.dtype), s] + ([o] if form.offset else [])
        if heads:
            parts = [unpermute(x, heads) for x in parts]
        per_layer.append([np.ascontiguousarray(x.T) for x in parts])
    if len(per_layer) == 1:
        return tuple(per_layer[0])
    return tuple(np.stack(xs) for xs in zip(*per_layer))


def load_base(p: Plan, abstract: Any, shardings: Any, rest: Callable[[Any, Any], Any]) -> Any:
    """The base of ``abstract`` (`layout`'s) placed with ``shardings``: the planned kernels read from the file's
    blocks, every other leaf by ``rest(abstract, shardings)`` (a tree with the planned kernels None, which it
    returns filled)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, GGUFBlocks))
    sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, (NamedSharding, GGUFBlocks)))
    others = jax.tree_util.tree_unflatten(treedef, [None if path in p.kernels else a for path, a in flat])
    others_sh = jax.tree_util.tree_unflatten(treedef, [None if path in p.kernels else s
                                                       for (path, _), s in zip(flat, sh, strict=True)])
    read = jax.tree_util.tree_flatten_with_path(rest(others, others_sh))[0]
    by_path = dict(read)
    tensors = read_header(p.path)[1]
    out = []
    for (path, a), s in zip(flat, sh, strict=True):
        if path not in p.kernels:
            out.append(by_path[path])
            continue
        arrays = read_kernel(p.path, tensors, *p.kernels[path])
        targets = [(a.qvalue, s.qvalue), (a.scale, s.scale)] + ([(a.offset, s.offset)] if a.offset is not None else [])
        placed = [jax.make_array_from_callback(x.shape, xs, lambda i, arr=arr: arr[i])
                  for (x, xs), arr in zip(targets, arrays, strict=True)]
        out.append(GGUFBlocks(*placed))
        del arrays
    return jax.tree_util.tree_unflatten(treedef, out)
