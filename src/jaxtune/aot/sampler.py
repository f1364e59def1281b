"""GRPO's sampler on a TPU slice: the run's own batch generation (`jaxtune.models.sampling.Generator`: the prefill
and the decode loop as one program, LoRA sampled from merged weights) compiled by libtpu for the rollout's shapes,
with the weights sharded as in training; its memory beside the training state that stays resident while it runs
(the KV cache as the compiled program holds it: its dtype read from the decode loop, on chip when it is small),
and a step estimate split into generation and training.

The estimate, per step: **prefill** = forward FLOPs of the prompts (2 x parameters x prompt tokens, each prompt
once for its group) / (chips x peak x `MFU_ASSUMED`); **decode** = ``max_completion_length`` positions, each bound
by HBM bandwidth: a chip reads its share of the weights and of the KV cache (counted full, an upper bound) per
position; **training** = the train step's roofline (`jaxtune.aot.report.roofline`) and, beside it, its model FLOPs
at `MFU_ASSUMED`, times the objective's passes per batch.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtune import sharding
from jaxtune.aot.step import Program
from jaxtune.models.lora import adapted_kernels
from jaxtune.models.sampling import Decode, Generator, Sampling, bucket

MFU_ASSUMED = 0.4  # the share of peak FLOP/s the compute-bound parts are assumed to reach (stated in the output)


def sampler_shapes(p: Program) -> dict[str, int]:
    """The rollout's shapes as the loop samples them: ``prompts`` (train.batch_size, each sampled ``group`` times),
    the prompt bucket and the KV cache's length (`Generator.__call__`'s buckets), and the new tokens at most."""
    cfg, max_seq = p.cfg, p.steps.spec.model_cfg.max_seq_len
    o = cfg.objective
    prompt = min(bucket(cfg.max_prompt_tokens), max_seq)
    cache = min(bucket(prompt + o.max_completion_length), max_seq)
    if prompt + o.max_completion_length > cache:
        prompt = cfg.max_prompt_tokens
    return {"prompts": cfg.train.batch_size, "group": o.num_generations,
            "rows": cfg.train.batch_size * o.num_generations, "prompt_len": prompt, "cache_len": cache,
            "max_new_tokens": o.max_completion_length}


_HLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "f8e5m2": 1}


def _kv_cache(p: Program, rows: int, cache_len: int, hlo: str) -> dict[str, Any]:
    """The KV cache on one chip: ``rows`` rows of ``cache_len`` positions, rows split over the data axes, positions
    over the context axis, KV heads over the tensor axis. Its dtype is the one the compiled program keeps it in,
    read from the decode loop's carried buffers (the TPU compiler stores a float32 cache in bfloat16 where the
    attention's matmuls read it at default precision anyway), else the compute dtype; and whether it lives on chip
    (VMEM, memory space 1: small caches) rather than in HBM."""
    m, mesh = p.steps.spec.model_cfg, p.mesh
    kv_heads = getattr(m, "n_kv_head", None) or m.n_head
    head_dim = getattr(m, "head_dim", None) or m.d_model // m.n_head
    ctx = mesh.shape["context"]  # the cache's slots are split along the context axis where it divides them
    heads = max(1, kv_heads // max(1, min(mesh.shape["tensor"], kv_heads)))
    slots = cache_len // ctx if cache_len % ctx == 0 else cache_len
    dims = (m.n_layer, math.ceil(rows / p.data_parallel), heads, slots, head_dim)  # the values' (L, B, K, S, H)
    loop = next((line for line in hlo.splitlines() if " while(" in line), "")
    shape = ",".join(map(str, dims))
    found = re.findall(rf"(\w+)\[{shape}\]\{{[^}}]*?(S\(1\))?\}}", loop)
    dtype = found[0][0] if found and found[0][0] in _HLO_BYTES else np.dtype(m.compute_dtype).name.replace(
        "float", "f")
    itemsize = _HLO_BYTES.get(dtype, np.dtype(m.compute_dtype).itemsize)
    return {"bytes": 2 * math.prod(dims) * itemsize, "dtype": dtype, "shape": dims, "read_from_program": bool(found),
            "on_chip": bool(found) and all(space for _, space in found)}


def compile_sampler(p: Program) -> dict[str, Any]:
    """The batch generation program for the rollout's shapes (`sampler_shapes`), compiled for the slice: memory per
    chip (and with the resident training state: whether sampling fits), its inputs' shares, and the compile time."""
    spec, shapes, started = p.steps.spec, sampler_shapes(p), time.perf_counter()
    gen = spec.generator()
    if not isinstance(gen, Generator):
        return {"skipped": f"model.backend={p.cfg.model.backend} samples with its own generator; it is not planned"}
    lora = gen.plain is not None  # LoRA sampled merged: the graph without adapters over the merged base
    if lora:
        target, weights = gen.plain, spec.frozen_abstract[0]
    elif spec.frozen_abstract:  # QLoRA: the adapters on the quantized base, unmerged
        target, weights = gen, (spec.abstract.params, *spec.frozen_abstract)
    else:
        target, weights = gen, spec.abstract.params
    o, mesh = p.cfg.objective, p.mesh
    rows_sh, replicated = sharding.batch_sharding(mesh), NamedSharding(mesh, P())
    n, plen = shapes["prompts"], shapes["prompt_len"]
    tokens = jax.ShapeDtypeStruct((n, plen), jnp.int32, sharding=rows_sh)
    valid = jax.ShapeDtypeStruct((n, plen), jnp.bool_, sharding=rows_sh)
    lengths = jax.ShapeDtypeStruct((shapes["rows"],), jnp.int32, sharding=rows_sh)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated)
    sampling = Sampling.of(o.temperature, o.top_k, None if o.top_p >= 1.0 else o.top_p, p.cfg.train.draw)
    decode = Decode(sampling, (0,), shapes["cache_len"], shapes["max_new_tokens"], shapes["group"])
    with sharding.use_mesh(mesh):
        lowered = Generator._generate.lower(target, weights, tokens, valid, key, lengths, decode=decode)
    compiled = lowered.compile()
    kv = _kv_cache(p, shapes["rows"], shapes["cache_len"], compiled.as_text())
    mem = compiled.memory_analysis()
    program = {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
               "temporaries": mem.temp_size_in_bytes, "code": mem.generated_code_size_in_bytes}
    # Resident while sampling: the training state (params, optimizer), the frozen weights (LoRA's base, a reference
    # copy, a teacher) and, with LoRA, the merged copies of the adapted kernels (the other arrays are the base's own).
    resident = sum(sharding.shard_bytes(a) for a in jax.tree.leaves((spec.abstract, p.steps.abstract_frozen())))
    merged = sum(sharding.shard_bytes(a) for a in adapted_kernels(spec.abstract.params, weights)) if lora else 0
    weights_b = sum(sharding.shard_bytes(a) for a in jax.tree.leaves(weights))
    whole = sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(weights))
    total = resident + merged + program["outputs"] + program["temporaries"] + program["code"]
    if not lora:  # the sampler's weights are the state's params, counted in resident
        total += program["arguments"] - weights_b
    return {**shapes, "program": program, "weights": weights_b, "weights_whole": whole, "merged_kernels": merged,
            "kv_cache": kv["bytes"], "kv_dtype": kv["dtype"], "kv_on_chip": kv["on_chip"],
            "kv_read_from_program": kv["read_from_program"], "resident": resident,
            "total": total, "fits": total <= p.slice.chip.hbm_usable, "lora_merged": lora,
            "compile_seconds": time.perf_counter() - started}


def step_estimate(p: Program, sampler: dict[str, Any], train_roofline: dict[str, Any] | None) -> dict[str, Any]:
    """Seconds per GRPO step: generation (prefill at `MFU_ASSUMED`, decode bound by HBM bandwidth) and training (the
    train step's roofline, and its model FLOPs at `MFU_ASSUMED`), times the objective's passes."""
    chip, chips = p.slice.chip, p.slice.chips
    params = p.steps.spec.model_cfg.num_params()
    prefill = 2 * params * sampler["prompts"] * sampler["prompt_len"] / (chips * chip.peak_flops * MFU_ASSUMED)
    per_token_bytes = sampler["weights"] + sampler["kv_cache"]
    decode = sampler["max_new_tokens"] * per_token_bytes / chip.hbm_bw
    passes = p.cfg.objective.passes
    out = {"mfu_assumed": MFU_ASSUMED, "prefill": prefill, "decode": decode, "generation": prefill + decode,
           "decode_bytes_per_token": per_token_bytes, "passes": passes}
    if train_roofline is not None:
        at_mfu = train_roofline["model_flops"] / (chips * chip.peak_flops * MFU_ASSUMED)
        out.update(training_roofline=passes * train_roofline["step_seconds"], training_at_mfu=passes * at_mfu)
        out["step"] = out["generation"] + max(out["training_roofline"], out["training_at_mfu"])
        if getattr(p.cfg.objective, "max_staleness", 0):
            out["overlap"] = overlapped(p, sampler, out)
    return out


def overlapped(p: Program, sampler: dict[str, Any], e: dict[str, Any]) -> dict[str, Any]:
    """``objective.max_staleness``'s step (`jaxtune.rollout.lagged`): on shared chips the device work is the sequential
    step's (what overlaps is the host's: rewards, tools); with ``mesh.rollout`` = r chips of the sampler's own, the
    longer of generation there (its weights whole on each chip, as the sampler's mesh holds them, the KV cache over r)
    and training on the other chips, both scaled from the slice's programs (linear in chips: an estimate)."""
    chips, r, k = p.slice.chips, p.cfg.mesh.rollout, p.cfg.objective.max_staleness
    if not r:
        return {"max_staleness": k, "rollout_chips": 0, "step": e["step"]}
    if r >= chips:
        return {"max_staleness": k, "rollout_chips": r,
                "refused": f"mesh.rollout={r} leaves the learner none of the {chips} chips"}
    per_token = sampler["weights_whole"] + sampler["kv_cache"] * chips / r  # bytes a sampler chip reads a position
    decode = sampler["max_new_tokens"] * per_token / p.slice.chip.hbm_bw
    generation = e["prefill"] * chips / r + decode
    training = max(e["training_roofline"], e["training_at_mfu"]) * chips / (chips - r)
    return {"max_staleness": k, "rollout_chips": r, "generation": generation, "training": training,
            "step": max(generation, training)}
