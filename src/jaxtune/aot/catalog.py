"""The Cloud TPU catalog a plan compiles for: each generation's chip (peak FLOP/s, HBM and the share of it a program
may use, HBM and ICI bandwidth, TensorCores per chip), the slice shapes of each generation, a slice by its
accelerator type (`tpu_slice`: ``v5e-8``, ``v5p-128``) and its abstract devices from libtpu (`slice_devices`)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Any

from jax.experimental import topologies

from jaxtune import runtime
from jaxtune.config import ConfigError

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
        raise AotError(f"--compile-for {s.name}: compiling for a TPU needs libtpu; pip install 'jaxtune[aot]' "
                      "(in a checkout: pip install -e '.[aot]')")
    kw: dict[str, Any] = {"chip_config_name": "megacore"} if s.chip.cores > 1 else {}
    if s.chips == 1:
        kw["chips_per_host_bounds"] = (1, 1, 1)  # the default host (2x2) does not divide a single chip
    return list(topologies.get_topology_desc(topology_name=s.topology, platform="tpu", **kw).devices)
