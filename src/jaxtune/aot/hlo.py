"""Reading a compiled program's HLO text: the matmul FLOPs (convolutions and dots), the HBM bytes its top-level ops
read and write, and the bytes its collectives move (per kind, and through each chip's ICI links in ring algorithms),
loop bodies counted times their trip count (XLA's known_trip_count, or a scan's ``i < N`` condition)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

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
    for line in _joined(hlo):
        if line and not line[0].isspace():
            if line.rstrip().endswith("{"):
                head = line.split()
                current = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
                comps[current] = []
                entry = current if head[0] == "ENTRY" else entry
            elif line.strip() == "}":
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


def _joined(hlo: str) -> list[str]:
    """The module's lines, an instruction whose attributes run over several lines (a Pallas kernel's metadata: JSON
    with newlines, its continuation lines at column 0, one of them starting with "}}") joined into one."""
    lines: list[str] = []
    for line in hlo.splitlines():
        header = line.startswith(("ENTRY ", "%", "HloModule")) or line.strip() == "}"
        if line and not line[0].isspace() and not header and lines and lines[-1][:1].isspace():
            lines[-1] += " " + line
        else:
            lines.append(line)
    return lines


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
    kernels: int = 0  # opaque kernel calls (Pallas/Mosaic ``tpu_custom_call``): their FLOPs are not in the HLO

    def add(self, other: HloCounts, times: float) -> None:
        self.flops += times * other.flops
        self.bytes += times * other.bytes
        self.ici_bytes += times * other.ici_bytes
        for k, v in other.collective_bytes.items():
            self.collective_bytes[k] += times * v
        self.loops += other.loops
        self.loops_unknown += other.loops_unknown
        self.kernels += int(times * other.kernels)


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
            elif op.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in op.attrs:
                c.kernels += 1
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
