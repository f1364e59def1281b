"""Plan a run on a Cloud TPU slice from any machine: ``jaxtune info CONFIG --compile-for v5e-8``.

The run's own train step (`jaxtune.train.step.run_steps`: what `train()` jits, with its model, LoRA and frozen base,
objective, remat, micro-batches, shardings and donation) is lowered on abstract inputs (no weights are read) for the
abstract devices of a TPU topology that libtpu describes, and compiled by the TPU compiler on this machine's CPU.
From the compiled program, per chip and per step: memory (XLA's memory analysis, against the HBM the compiler lets a
program use), the matmul FLOPs, the bytes its ops read and write, and the bytes its collectives move (all read from
the HLO, loop bodies counted times their trip count), then a roofline step time, MFU and tokens/s. `largest_batch`
searches the largest global batch the compiler accepts.

Every number is for one chip: the compiled module is the SPMD program each device runs (a matmul sharded 8 ways
reports 1/8 of its FLOPs), and on v4 and v5p a device is a whole chip (both TensorCores, "megacore").
"""

from __future__ import annotations

import importlib.util
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from jaxtune import runtime, sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import Config, ConfigError
from jaxtune.data.pipeline import PRETRAINING_FORMATS
from jaxtune.info import planned
from jaxtune.models.family import check_fits
from jaxtune.train.step import Steps, run_steps

GiB = 2**30


class AotError(ConfigError):
    """A TPU slice that cannot be planned (unknown name, libtpu missing): the message says what to do."""


@dataclass(frozen=True)
class Chip:
    """One TPU generation's chip. Figures are Google's Cloud TPU documentation (``source``) unless noted;
    ``hbm_usable`` is what libtpu 0.0.42's compiler lets one program use ("exceeds available HBM (15.75G)" in its
    out-of-memory error on v5e), the budget a plan is checked against."""

    generation: str  # as topology names spell it ("v5e" in "v5e:2x4")
    peak_flops: float  # bf16 FLOP/s
    hbm: float  # documented HBM capacity, bytes
    hbm_usable: float  # bytes
    hbm_bw: float  # bytes/s
    ici_bw: float  # inter-chip interconnect, bytes/s per chip: all ports, both directions
    ici_ports: int  # links per chip (2 per torus axis)
    cores: int  # TensorCores per chip: v4 and v5p slice names count these
    source: str

    @property
    def ici_axis_bw(self) -> float:
        """Bytes/s a chip receives in a ring collective over one torus axis: its two links on that axis, one way
        each (a bidirectional ring)."""
        return self.ici_bw / self.ici_ports


CHIPS = {
    # v4's page states no per-chip ICI figure: 6 links x 45 GB/s each way (the JAX scaling book's TPU table,
    # https://jax-ml.github.io/scaling-book/tpus/).
    "v4": Chip("v4", 275e12, 32 * GiB, 30.75 * GiB, 1200e9, 540e9, 6, 2, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", 197e12, 16 * GiB, 15.75 * GiB, 819e9, 400e9, 4, 1, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", 459e12, 95 * GiB, 95.74 * GiB, 2765e9, 1200e9, 6, 2, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", 918e12, 32 * GiB, 31.25 * GiB, 1600e9, 800e9, 4, 1, "https://cloud.google.com/tpu/docs/v6e"),
}
# Slice shapes (chips -> topology) from the same pages: 2D tori for v5e/v6e, 3D for v4/v5p.
_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8",
       1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
SHAPES = {"v4": _3D, "v5e": _2D, "v5p": {**_3D, 6144: "16x16x24"}, "v6e": _2D}
ALIASES = {"v5litepod": "v5e"}


@dataclass(frozen=True)
class TpuSlice:
    name: str  # as given: v5p-128
    chip: Chip
    chips: int

    @property
    def topology(self) -> str:
        """What `jax.experimental.topologies.get_topology_desc` takes: ``v5p:4x4x4``."""
        return f"{self.chip.generation}:{SHAPES[self.chip.generation][self.chips]}"


def tpu_slice(name: str) -> TpuSlice:
    """A Cloud TPU slice by its accelerator type: ``v5e-8`` (or ``v5litepod-8``) and ``v6e-256`` count chips,
    ``v4-8`` and ``v5p-128`` count TensorCores (2 per chip: v5p-128 is 64 chips)."""
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name.strip())
    gen = ALIASES.get(m.group(1), m.group(1)) if m else None
    if gen not in CHIPS:
        raise AotError(f"--compile-for {name!r}: not a Cloud TPU slice name; give GENERATION-SIZE with a generation "
                       f"of {sorted(CHIPS)} (v5litepod for v5e), e.g. v5e-8, v5p-128, v6e-256, v4-8")
    chip, count = CHIPS[gen], int(m.group(2))
    chips = count // chip.cores
    if count % chip.cores or chips not in SHAPES[gen]:
        unit = "TensorCores, 2 per chip" if chip.cores > 1 else "chips"
        sizes = ", ".join(f"{gen}-{n * chip.cores}" for n in SHAPES[gen])
        raise AotError(f"--compile-for {name}: {gen} slice sizes count {unit}; the slices are {sizes}")
    return TpuSlice(name, chip, chips)


def slice_devices(s: TpuSlice) -> list[Any]:
    """The slice's abstract devices, one per chip (v4 and v5p in megacore mode, as a TPU VM runs them)."""
    runtime.quiet_libtpu()  # a second JAX process on this host could not make a topology otherwise
    if importlib.util.find_spec("libtpu") is None:
        raise AotError(f"--compile-for {s.name}: compiling for a TPU needs libtpu; pip install 'jaxtune[aot]'")
    kw: dict[str, Any] = {"chip_config_name": "megacore"} if s.chip.cores > 1 else {}
    if s.chips == 1:
        kw["chips_per_host_bounds"] = (1, 1, 1)  # the default host (2x2) does not divide a single chip
    return list(topologies.get_topology_desc(topology_name=s.topology, platform="tpu", **kw).devices)


# -- the compiled program's HLO -----------------------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
             "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
             "c64": 8, "c128": 16}
# Ops that move no data of their own (or whose data is counted elsewhere: collectives as ICI traffic).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "opt-barrier", "async-start", "async-update",
               *COLLECTIVES, *(f"{c}-start" for c in COLLECTIVES)}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")


def _nbytes(type_text: str, hbm: bool = False) -> float:
    """Bytes of the arrays in an HLO type (a tuple's elements summed); ``hbm``: only those in HBM, memory space 0
    (a layout's ``S(1)`` is on-chip vector memory)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dt]
               for dt, dims, layout in _ARRAY.findall(type_text)
               if dt in _ITEMSIZE and not (hbm and re.search(r"S\([1-9]", layout)))


def _hbm_traffic(op: _Op, ops: dict[str, _Op]) -> float:
    """HBM bytes a top-level op reads and writes. An async copy or slice (``copy-start``, ``slice-start``) returns
    its operand, its destination and a context: it moves (result - operands) bytes, read from HBM if the source is
    there and written to HBM if the destination is."""
    operands = [ops[n].type for n in op.operands if n in ops]
    read = sum(_nbytes(t, hbm=True) for t in operands)
    if not op.opcode.endswith("-start"):
        return read + _nbytes(op.type, hbm=True)
    moved = max(_nbytes(op.type) - sum(_nbytes(t) for t in operands), 0.0)
    return (moved if read else 0.0) + max(_nbytes(op.type, hbm=True) - read, 0.0)


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


@dataclass
class _Op:
    name: str
    type: str  # the result's HLO type
    opcode: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses (a constant's value)
    attrs: str  # everything after them


def _parse(hlo: str) -> tuple[dict[str, list[_Op]], str]:
    """Computations (name -> ops) and the entry computation's name."""
    comps: dict[str, list[_Op]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if line and not line[0].isspace():
            if line.rstrip().endswith("{"):
                head = line.split()
                current = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
                comps[current] = []
                entry = current if head[0] == "ENTRY" else entry
            elif line.startswith("}"):
                current = None
            continue
        m = _INSTR.match(line)
        o = _OPCODE.search(" " + m.group(2)) if m and current is not None else None
        if o is None:
            continue
        rest = " " + m.group(2)
        start, depth = o.end(), 1
        for i in range(start, len(rest)):
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            if depth == 0:
                break
        operands = re.findall(r"%([^\s,()]+)", rest[start:i])
        comps[current].append(_Op(m.group(1), rest[1:o.start()], o.group(1), operands, rest[start:i], rest[i + 1:]))
    return comps, entry


def _trip_count(while_op: _Op, comps: dict[str, list[_Op]], ops: dict[str, _Op]) -> int | None:
    """A while loop's iterations: XLA's known_trip_count, or a condition ``i < N`` on a counter that starts at a
    constant (how `jax.lax.scan` and `fori_loop` compile); None when the HLO does not say."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_op.attrs)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%([^\s,]+)", while_op.attrs)
    root = comps.get(cond.group(1), [])[-1:] if cond else []
    if not root or root[0].opcode != "compare" or "direction=LT" not in root[0].attrs:
        return None
    limits = [_constant(ops[n]) for n in root[0].operands if n in ops and ops[n].opcode == "constant"]
    init = ops.get(while_op.operands[0]) if while_op.operands else None
    first = ops.get(init.operands[0]) if init is not None and init.opcode == "tuple" and init.operands else None
    start = _constant(first) if first is not None and first.opcode == "constant" else 0
    if len(limits) != 1 or limits[0] is None or start is None:
        return None
    return max(limits[0] - start, 0)


def _constant(op: _Op) -> int | None:
    """The value of an integer scalar constant (``s32[] constant(3)``)."""
    return int(op.args) if re.fullmatch(r"-?\d+", op.args.strip()) else None


def _valid_taps(out: int, win: int, stride: int, lo: int, base: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """Window taps that land on a real input element (not padding, not a dilation hole), over all output
    positions of one spatial dimension: what a convolution multiplies along it."""
    o = np.arange(out)[:, None]
    pos = o * stride + np.arange(win)[None, :] * rhs_dilate - lo
    size = (base - 1) * lhs_dilate + 1
    return int(((pos >= 0) & (pos < size) & (pos % lhs_dilate == 0)).sum())


def _conv_flops(op: _Op, ops: dict[str, _Op]) -> float:
    """2 x multiply-adds of a convolution (TPU HLO writes its matmuls as convolutions), counting only taps on real
    input elements, as XLA's cost analysis does."""
    labels = re.search(r"dim_labels=([^_\s]+)_([^-\s]+)->([^,\s]+)", op.attrs)
    if labels is None or len(op.operands) < 2 or op.operands[1] not in ops:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, rhs, out = _dims(ops[op.operands[0]].type), _dims(ops[op.operands[1]].type), _dims(op.type)
    window = dict(re.findall(r"(\w+)=([\dx_-]+)", (re.search(r"window=\{([^}]*)\}", op.attrs) or [None, ""])[1]))
    n = len([c for c in out_l if c.isdigit()])

    def per_dim(key: str, default: str) -> list[str]:
        return window.get(key, "x".join([default] * n)).split("x") if n else []

    size, stride, pad = per_dim("size", "1"), per_dim("stride", "1"), per_dim("pad", "0_0")
    lhs_dil, rhs_dil = per_dim("lhs_dilate", "1"), per_dim("rhs_dilate", "1")
    taps = 1
    for d in range(n):
        taps *= _valid_taps(out[out_l.index(str(d))], int(size[d]), int(stride[d]), int(pad[d].split("_")[0]),
                            lhs[lhs_l.index(str(d))], int(lhs_dil[d]), int(rhs_dil[d]))
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def _dot_flops(op: _Op, ops: dict[str, _Op]) -> float:
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attrs)
    if contracting is None or op.operands[0] not in ops:
        return 0.0
    lhs = _dims(ops[op.operands[0]].type)
    k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i)
    return 2.0 * math.prod(_dims(op.type)) * k


def _group_size(attrs: str, devices: int) -> int | None:
    """Devices per replica group of a collective, from any of the ways HLO prints them."""
    if m := re.search(r"replica_groups=\{\{([^}]*)\}", attrs):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", attrs):
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes.get(a, 0)) for a in re.findall(r"'([^']+)'", m.group(2))) or None
    if "replica_groups={}" in attrs:
        return devices
    return None


@dataclass
class HloCounts:
    """What one chip's program does per step, loop bodies counted times their trip count."""

    flops: float = 0.0  # matmul FLOPs (convolutions and dots)
    bytes: float = 0.0  # HBM bytes read and written by the top-level ops (fusions' insides stay on chip)
    collective_bytes: dict[str, float] | None = None  # per kind: the larger of operand and result, per op
    ici_bytes: float = 0.0  # what the collectives move through one chip in ring algorithms
    loops: int = 0
    loops_unknown: int = 0  # loops whose trip count the HLO does not show: counted once

    def add(self, other: HloCounts, times: float) -> None:
        self.flops += times * other.flops
        self.bytes += times * other.bytes
        self.ici_bytes += times * other.ici_bytes
        for k, v in other.collective_bytes.items():
            self.collective_bytes[k] += times * v
        self.loops += other.loops
        self.loops_unknown += other.loops_unknown


def hlo_counts(hlo: str, devices: int) -> HloCounts:
    """`HloCounts` of a compiled module's text (``compiled.as_text()``) for a program on ``devices`` devices.

    Collectives: each op's bytes are the larger of its operand and result (the gathered array of an all-gather, the
    scattered one of a reduce-scatter): the array a ring streams through each chip. ICI traffic is that times
    (N-1)/N for a group of N (2 (N-1)/N for an all-reduce: a reduce-scatter then an all-gather; 1 for a permute).
    Async pairs are counted once, at their ``-done``, with the ``-start``'s operands."""
    comps, entry = _parse(hlo)
    ops = {op.name: op for body in comps.values() for op in body}
    memo: dict[tuple[str, bool], HloCounts] = {}

    def visit(comp: str, fused: bool) -> HloCounts:
        if (comp, fused) in memo:
            return memo[comp, fused]
        c = HloCounts(collective_bytes=dict.fromkeys(COLLECTIVES, 0.0))
        for op in comps.get(comp, []):
            if op.opcode == "convolution":
                c.flops += _conv_flops(op, ops)
            elif op.opcode == "dot":
                c.flops += _dot_flops(op, ops)
            kind = op.opcode.removesuffix("-done")
            if kind in COLLECTIVES:
                source = ops.get(op.operands[0]) if op.opcode.endswith("-done") and op.operands else op
                operand = sum(_nbytes(ops[n].type) for n in source.operands if n in ops)
                size = max(operand, _nbytes(op.type))
                n = _group_size(source.attrs, devices)
                share = 1.0 if kind == "collective-permute" or n is None else (n - 1) / n
                c.collective_bytes[kind] += size
                c.ici_bytes += size * share * (2 if kind == "all-reduce" else 1)
            if not fused and op.opcode not in _NO_TRAFFIC and not op.opcode.endswith("-done"):
                c.bytes += _hbm_traffic(op, ops)
            if op.opcode == "while":
                body = re.search(r"body=%([^\s,]+)", op.attrs).group(1)
                trips = _trip_count(op, comps, ops)
                c.add(visit(body, fused), trips if trips is not None else 1)
                c.loops += 1
                c.loops_unknown += trips is None
            elif op.opcode == "conditional":
                branches = re.findall(r"%([^\s,{}]+)", (re.search(r"branch_computations=\{([^}]*)\}", op.attrs)
                                                        or [None, ""])[1]) or re.findall(
                    r"(?:true|false)_computation=%([^\s,]+)", op.attrs)
                if branches:
                    c.add(max((visit(b, fused) for b in branches), key=lambda x: x.flops), 1)
            elif op.opcode in ("fusion", "async-start") or op.opcode == "call":
                callee = re.search(r"(?:calls|to_apply)=%([^\s,]+)", op.attrs)
                if callee:
                    c.add(visit(callee.group(1), fused or op.opcode == "fusion"), 1)
        memo[comp, fused] = c
        return c

    return visit(entry, False)


# -- compiling the run's step -------------------------------------------------------------------------------------


def abstract_batch(cfg: Config, batch_size: int, mesh: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch the train step takes, as the loop hands it over (`jaxtune.data.make_training_data`; GRPO:
    `jaxtune.train.rollout.training_rows`), sharded over the data-parallel axes. Pretraining windows: ``inputs`` and
    ``targets``; fine-tuning rows also ``positions``, ``segment_ids`` and ``loss_mask``; preference pairs are
    (B, 2, T), with ``ref_logps`` (B, 2) when precomputed; GRPO trains on B x num_generations completions with
    their ``advantages``."""
    t, fmt, obj = cfg.data.seq_len, cfg.data.format, cfg.objective
    rows: tuple[int, ...] = (batch_size,)
    extra: dict[str, tuple[tuple[int, ...], Any]] = {}
    if fmt == "preference":
        rows = (batch_size, 2)
        if obj.uses_reference and obj.precompute_ref_logps:
            extra["ref_logps"] = ((batch_size, 2), jnp.float32)
    elif fmt == "prompts":
        rows = (batch_size * obj.num_generations,)
        extra["advantages"] = (rows, jnp.float32)
    keys = ("inputs", "targets") if fmt in PRETRAINING_FORMATS else ("inputs", "targets", "positions", "segment_ids")
    shapes = {k: ((*rows, t), jnp.int32) for k in keys}
    if fmt not in PRETRAINING_FORMATS:
        shapes["loss_mask"] = ((*rows, t), jnp.float32)
    sh = sharding.batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct(shape, dt, sharding=sh) for k, (shape, dt) in {**shapes, **extra}.items()}


@dataclass
class Program:
    """The run's train step on one slice: built once, compiled for any global batch size."""

    cfg: Config
    slice: TpuSlice
    mesh: Any
    steps: Steps
    note: str | None  # `jaxtune.info.planned`'s

    @property
    def data_parallel(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    @property
    def batch_unit(self) -> int:
        """Global batch sizes must be multiples of this: each micro-batch spread evenly over the data axes."""
        return self.data_parallel * self.cfg.train.micro_batches

    def compile(self, batch_size: int) -> dict[str, Any]:
        """Compile the step for ``batch_size`` sequences: memory per chip (or the compiler's out-of-memory
        numbers), the HLO's counts and XLA's cost analysis."""
        spec, started = self.steps.spec, time.perf_counter()
        frozen = spec.frozen_abstract
        if self.steps.reference is not None and self.steps.reference.copy:
            frozen = (*frozen, spec.abstract.params)  # the reference's frozen copy rides with the frozen groups
        with sharding.use_mesh(self.mesh):
            lowered = self.steps.train.lower(spec.abstract, abstract_batch(self.cfg, batch_size, self.mesh), frozen)
        args = sum(_shard_bytes(a) for a in jax.tree.leaves((spec.abstract, frozen)))
        out: dict[str, Any] = {"batch_size": batch_size, "usable_hbm": self.slice.chip.hbm_usable}
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            need = _oom_bytes(str(e))
            total = None if need is None else need + args  # the message counts the temporaries alone
            out.update(fits=False, memory={"total": total, "temporaries": need, "state_and_frozen": args},
                       compiler=str(e).split("\n")[0], compile_seconds=time.perf_counter() - started)
            return out
        mem = compiled.memory_analysis()
        memory = {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                  "aliased": mem.alias_size_in_bytes, "temporaries": mem.temp_size_in_bytes,
                  "code": mem.generated_code_size_in_bytes}
        memory["total"] = (memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
                           + memory["code"])
        cost = compiled.cost_analysis() or {}
        hlo = hlo_counts(compiled.as_text(), len(self.mesh.devices.flat))
        out.update(fits=memory["total"] <= self.slice.chip.hbm_usable, memory=memory, hlo=hlo,
                   xla_cost={"flops": cost.get("flops"), "bytes accessed": cost.get("bytes accessed")},
                   compile_seconds=time.perf_counter() - started)
        return out


def _shard_bytes(a: jax.ShapeDtypeStruct) -> int:
    return math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize


def _oom_bytes(message: str) -> float | None:
    """The bytes a refused program needed, from the TPU compiler's out-of-memory message ("the total memory required
    for HLO temporaries (28.66G) exceeds available HBM (15.75G)", or "Used 20.1G of 15.75G hbm")."""
    m = (re.search(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)", message)
         or re.search(r"Used ([\d.]+)([KMGT]?) of", message))
    return float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2) or "_") if m else None


def program(cfg: Config, target: str) -> Program:
    """The run's train step for the slice ``target`` (`tpu_slice`), with the mesh of ``cfg.mesh`` over its chips."""
    s = tpu_slice(target)
    devices = slice_devices(s)
    cfg, vocab, note = planned(cfg)
    try:
        mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
    except sharding.ShardingError as e:
        raise sharding.ShardingError(f"--compile-for {s.name} ({len(devices)} chips): {e}") from None
    spec = make_state_spec(cfg, vocab, mesh)
    check_fits(spec.model_cfg.vocab_size, spec.model_cfg.max_seq_len, seq_len=cfg.data.seq_len)
    return Program(cfg, s, mesh, run_steps(spec, cfg), note)


def roofline(p: Program, compiled: dict[str, Any]) -> dict[str, Any]:
    """Step time as the slowest of compute, HBM traffic and ICI traffic at the chip's peak rates (no overlap
    modelled beyond taking the maximum), MFU against the analytic model FLOPs, tokens/s."""
    chip, hlo, b = p.slice.chip, compiled["hlo"], compiled["batch_size"]
    times = {"compute": hlo.flops / chip.peak_flops, "HBM": hlo.bytes / chip.hbm_bw,
             "ICI": hlo.ici_bytes / chip.ici_axis_bw}
    bound = max(times, key=times.get)
    step = times[bound]
    tokens = b * p.cfg.data.seq_len
    model_flops = p.steps.spec.model_cfg.flops_per_token(p.cfg.data.seq_len) * tokens
    return {"seconds": times, "step_seconds": step, "bound": bound, "model_flops": model_flops,
            "mfu": model_flops / (p.slice.chips * step * chip.peak_flops) if step else None,
            "tokens_per_second": tokens / step if step else None}


def largest_batch(p: Program, first: dict[str, Any], budget_seconds: float) -> dict[str, Any]:
    """The largest global batch (a multiple of `Program.batch_unit`) the compiler accepts within the slice's HBM:
    doubling from the compiled ``first`` batch until one is refused (halving if ``first`` was), then bisection,
    compiling each candidate, until ``budget_seconds`` of compiling is spent. ``exact``: the neighbours were
    settled (the next multiple was refused); ``tried``: (batch, fits, bytes per chip) of each compile, in order
    (a refused one's bytes are at least what the compiler asked for)."""
    unit, spent = p.batch_unit, first["compile_seconds"]
    k = first["batch_size"] // unit
    lo, hi = (k, None) if first["fits"] else (0, k)
    tried = [(first["batch_size"], first["fits"], first["memory"]["total"])]

    def fits(k: int) -> bool:
        nonlocal spent
        r = p.compile(k * unit)
        spent += r["compile_seconds"]
        tried.append((k * unit, r["fits"], r["memory"]["total"]))
        return r["fits"]

    while spent < budget_seconds and (hi is None or (lo == 0 and hi > 1)):
        k = lo * 2 if hi is None else hi // 2
        if fits(k):
            lo = k
        else:
            hi = k
    while spent < budget_seconds and hi is not None and hi - lo > 1:
        k = (lo + hi) // 2
        lo, hi = (k, hi) if fits(k) else (lo, k)
    return {"batch_size": lo * unit or None, "refused": hi * unit if hi else None, "unit": unit,
            "exact": hi is not None and hi - lo == 1, "compiles": len(tried), "compile_seconds": spent,
            "tried": tried}


def plan(cfg: Config, target: str, search_seconds: float = 0.0) -> dict[str, Any]:
    """``cfg``'s train step compiled for the slice ``target`` at train.batch_size: memory per chip and whether it
    fits, FLOPs, HBM and collective bytes per chip and step, the roofline (when it compiled), and with
    ``search_seconds`` > 0 the largest batch that fits (`largest_batch`)."""
    p = program(cfg, target)
    b, unit = p.cfg.train.batch_size, p.batch_unit
    if b % unit:
        raise sharding.ShardingError(
            f"train.batch_size={b}: on {p.slice.name} it must be a multiple of {unit} (the data-parallel degree "
            f"{p.data_parallel} x train.micro_batches {p.cfg.train.micro_batches}), e.g. {max(b // unit, 1) * unit}")
    r = p.compile(b)
    chip = p.slice.chip
    out: dict[str, Any] = {
        "slice": {"name": p.slice.name, "chips": p.slice.chips, "topology": p.slice.topology,
                  "device_kind": p.mesh.devices.flat[0].device_kind, "peak_flops": chip.peak_flops, "hbm": chip.hbm,
                  "hbm_usable": chip.hbm_usable, "hbm_bw": chip.hbm_bw, "ici_bw": chip.ici_bw,
                  "ici_axis_bw": chip.ici_axis_bw, "source": chip.source},
        "mesh": dict(p.mesh.shape), "batch_size": b, "seq_len": p.cfg.data.seq_len,
        "micro_batches": p.cfg.train.micro_batches, "fits": r["fits"], "memory": r["memory"],
        "compile_seconds": r["compile_seconds"], "note": p.note,
    }
    total = r["memory"]["total"]
    if total is not None:
        out["headroom"] = chip.hbm_usable - total
    if "compiler" in r:
        out["compiler"] = r["compiler"]
    if "hlo" in r:
        hlo = r["hlo"]
        out.update(flops_per_chip=hlo.flops, hbm_bytes_per_chip=hlo.bytes, collective_bytes=hlo.collective_bytes,
                   ici_bytes=hlo.ici_bytes, loops=hlo.loops, loops_unknown=hlo.loops_unknown, xla_cost=r["xla_cost"],
                   roofline=roofline(p, r))
    if search_seconds > 0:
        out["largest_batch"] = largest_batch(p, r, search_seconds)
    return out


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def format_plan(d: dict[str, Any]) -> str:
    s, m = d["slice"], d["memory"]
    usable = s["hbm_usable"]
    micro = f" in {d['micro_batches']} micro-batches" if d["micro_batches"] > 1 else ""
    head = (f"compiled for:     {s['name']}: {s['chips']} chips of {s['device_kind']} (topology {s['topology']}), "
            f"mesh {d['mesh']}, batch {d['batch_size']} x {d['seq_len']} tokens{micro}; compiled in "
            f"{d['compile_seconds']:.0f} s")
    lines = [head]
    if d["fits"]:
        lines.append(f"memory / chip:    arguments {_gib(m['arguments'])}, outputs {_gib(m['outputs'])} "
                     f"({_gib(m['aliased'])} of them in donated arguments), temporaries {_gib(m['temporaries'])}, "
                     f"code {_gib(m['code'])}: {_gib(m['total'])} of {_gib(usable)} usable HBM: fits, "
                     f"{_gib(d['headroom'])} ({100 * d['headroom'] / usable:.1f}%) free")
    elif m["total"] is not None:
        over = m["total"] - usable
        lines.append(f"memory / chip:    does not fit: at least {_gib(m['total'])} (the compiler's "
                     f"{_gib(m['temporaries'])} of temporaries + {_gib(m['state_and_frozen'])} of state and frozen "
                     f"weights) of {_gib(usable)} usable HBM: over by {_gib(over)} ({100 * over / usable:.0f}%)")
    else:
        lines.append(f"memory / chip:    does not fit: {d['compiler']}")
    if "roofline" in d:
        rl, t = d["roofline"], d["roofline"]["seconds"]
        moved = ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in d["collective_bytes"].items() if v) or "none"
        unknown = (f"; {d['loops_unknown']} of {d['loops']} loops have no readable trip count and count once"
                   if d["loops_unknown"] else "")
        lines.append(f"FLOPs / chip:     {d['flops_per_chip']:.3e} per step (the HLO's matmuls, loop bodies x trip "
                     f"count; XLA's cost analysis, which counts a loop body once: {d['xla_cost']['flops'] or 0:.3e})")
        lines.append(f"HBM bytes / chip: {d['hbm_bytes_per_chip']:.3e} per step (read and written by top-level ops)")
        lines.append(f"collectives:      {moved} per chip and step; {d['ici_bytes'] / 1e6:,.1f} MB through each "
                     f"chip's ICI links in ring algorithms{unknown}")
        lines.append(f"roofline:         compute {1e3 * t['compute']:.1f} ms, HBM {1e3 * t['HBM']:.1f} ms, ICI "
                     f"{1e3 * t['ICI']:.1f} ms: {1e3 * rl['step_seconds']:.1f} ms per step ({rl['bound']}-bound); "
                     f"MFU {100 * rl['mfu']:.1f}% (model FLOPs {rl['model_flops']:.3e}), "
                     f"{rl['tokens_per_second']:,.0f} tokens/s")
    if "largest_batch" in d:
        lb = d["largest_batch"]
        found = f"{lb['batch_size']} fits" if lb["batch_size"] else f"none fits (not even {lb['unit']})"
        refused = f", {lb['refused']} does not" if lb["refused"] else ", no refusal found yet"
        budget = "" if lb["exact"] else "; stopped by the time budget"
        lines.append(f"largest batch:    {found}{refused} (multiples of {lb['unit']}; {lb['compiles']} compiles, "
                     f"{lb['compile_seconds']:.0f} s{budget})")
    return "\n".join(lines)
