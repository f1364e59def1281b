"""The run's own train step (`jaxtune.train.step.run_steps`) built for a TPU slice's abstract devices and compiled
by libtpu for a global batch size (`Program.compile`): the batch it takes (`abstract_batch`), memory per chip from
XLA's memory analysis (or the compiler's out-of-memory numbers), the HLO's counts (`jaxtune.aot.hlo`) and XLA's
cost analysis."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune import sharding
from jaxtune.aot.catalog import TpuSlice, slice_devices, tpu_slice
from jaxtune.aot.hlo import hlo_counts
from jaxtune.backends import make_state_spec
from jaxtune.companions import loaded_companion
from jaxtune.config import Config
from jaxtune.info import planned
from jaxtune.models.fits import check_fits
from jaxtune.train.step import Steps, run_steps


def abstract_batch(cfg: Config, batch_size: int, mesh: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch the train step takes, as the loop hands it over (`jaxtune.data.make_training_data`; GRPO:
    `jaxtune.rollout.rollout.training_rows`), sharded over the data-parallel axes: the arrays its batch kind declares
    (`jaxtune.config.kinds.BatchKind.step_arrays`). Pretraining windows: ``inputs`` and ``targets``; fine-tuning rows
    also ``positions``, ``segment_ids`` and ``loss_mask``; preference pairs are (B, 2, T), with ``ref_logps`` (B, 2)
    when precomputed; GRPO trains on B x num_generations completions with their ``advantages``."""
    arrays = cfg.data.kind.step_arrays(batch_size, cfg.data.seq_len, cfg.objective, cfg.data.shares_prompts)
    sh = sharding.batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sh) for k, (shape, dt) in arrays.items()}


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
    def sequences(self) -> int:
        """Sequences per item of the batch (a preference pair 2, a GRPO prompt its num_generations completions)."""
        return self.cfg.data.kind.sequences_per_item(self.cfg.objective)

    @property
    def trained(self) -> int:
        """Of those, the sequences the step trains on (KTO's KL row only runs forward: not counted)."""
        return self.cfg.data.kind.trained_per_item(self.cfg.objective)

    @property
    def batch_unit(self) -> int:
        """Global batch sizes must be multiples of this: each micro-batch spread evenly over the data axes."""
        return self.data_parallel * self.cfg.train.micro_batches

    def compile(self, batch_size: int) -> dict[str, Any]:
        """Compile the step for ``batch_size`` sequences: memory per chip (or the compiler's out-of-memory
        numbers), the HLO's counts and XLA's cost analysis."""
        spec, started = self.steps.spec, time.perf_counter()
        frozen = self.steps.abstract_frozen()  # the model's frozen groups and the companion's weights, if it holds any
        with sharding.use_mesh(self.mesh):
            lowered = self.steps.train.lower(spec.abstract, abstract_batch(self.cfg, batch_size, self.mesh), frozen)
        args = sum(sharding.shard_bytes(a) for a in jax.tree.leaves((spec.abstract, frozen)))
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
                  "code": mem.generated_code_size_in_bytes,
                  "host": mem.host_temp_size_in_bytes}  # the host memory the program keeps (model.remat=offload)
        memory["total"] = (memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
                           + memory["code"])
        cost = compiled.cost_analysis() or {}
        hlo = hlo_counts(compiled.as_text(), len(self.mesh.devices.flat))
        out.update(fits=memory["total"] <= self.slice.chip.hbm_usable, memory=memory, hlo=hlo,
                   xla_cost={"flops": cost.get("flops"), "bytes accessed": cost.get("bytes accessed")},
                   compile_seconds=time.perf_counter() - started)
        return out



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
        mesh = sharding.mesh_of(cfg.mesh, devices)
    except sharding.ShardingError as e:
        raise sharding.ShardingError(f"--compile-for {s.name} ({len(devices)} chips): {e}") from None
    spec = make_state_spec(cfg, vocab, mesh)
    check_fits(spec.model_cfg.vocab_size, spec.model_cfg.max_seq_len, seq_len=cfg.data.seq_len)
    return Program(cfg, s, mesh, run_steps(spec, cfg, loaded_companion(cfg, mesh, spec.model_cfg.vocab_size)), note)
