"""Plan a run on a Cloud TPU slice from any machine: ``jaxtune info CONFIG --compile-for v5e-8``.

The run's own train step (`jaxtune.train.step.run_steps`: what `train()` jits, with its model, LoRA and frozen base,
objective, remat, micro-batches, shardings and donation) is lowered on abstract inputs (no weights are read) for the
abstract devices of a TPU topology that libtpu describes, and compiled by the TPU compiler on this machine's CPU.
From the compiled program, per chip and per step: memory (XLA's memory analysis, against the HBM the compiler lets a
program use), the matmul FLOPs, the bytes its ops read and write, and the bytes its collectives move (all read from
the HLO, loop bodies counted times their trip count), then a roofline step time, MFU and tokens/s. `largest_batch`
and `longest_sequence` search the largest global batch and the longest sequence the compiler accepts.

Every number is for one chip: the compiled module is the SPMD program each device runs (a matmul sharded 8 ways
reports 1/8 of its FLOPs), and on v4 and v5p a device is a whole chip (both TensorCores, "megacore").

Its modules: `jaxtune.aot.catalog` (the TPU chips and slices), `jaxtune.aot.hlo` (reading the compiled HLO),
`jaxtune.aot.step` (the run's step compiled for a slice), `jaxtune.aot.search` (the largest batch, the longest
sequence), `jaxtune.aot.report` (the roofline and the plan as numbers and text).
"""

from jaxtune.aot.catalog import ALIASES, CHIPS, SHAPES, AotError, Chip, GiB, TpuSlice, slice_devices, tpu_slice
from jaxtune.aot.hlo import COLLECTIVES, HloCounts, hlo_counts
from jaxtune.aot.report import format_plan, plan, roofline
from jaxtune.aot.search import largest_batch, longest_sequence
from jaxtune.aot.step import Program, abstract_batch, program

__all__ = [
    "ALIASES",
    "CHIPS",
    "COLLECTIVES",
    "SHAPES",
    "AotError",
    "Chip",
    "GiB",
    "HloCounts",
    "Program",
    "TpuSlice",
    "abstract_batch",
    "format_plan",
    "hlo_counts",
    "largest_batch",
    "longest_sequence",
    "plan",
    "program",
    "roofline",
    "slice_devices",
    "tpu_slice",
]
