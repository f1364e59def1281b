"""What a config will cost before it runs: parameters, FLOPs per token, memory per device."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import Config, NativeModelConfig
from jaxtune.models.resolve import planned_section


def _bytes_per_device(abstract: Any) -> int:
    """Bytes one device holds for a tree of sharded ShapeDtypeStructs."""
    return sum(sharding.shard_bytes(a) for a in jax.tree.leaves(abstract))


def planned(cfg: Config, vocab_size: int | None = None) -> tuple[Config, int | None, str | None]:
    """(``cfg`` as it is planned, the vocabulary size, a note) without reading a tokenizer or weights: a hub
    checkpoint whose config.json cannot be read (offline) is planned from its family preset, and the note says so;
    the vocabulary is ``vocab_size``, else model.vocab_size, else tokenizer.vocab_size (for bpe; else None: the
    checkpoint's or the preset's)."""
    model, note = planned_section(cfg.model)
    cfg = cfg.model_copy(update={"model": model})
    bpe_vocab = cfg.tokenizer.vocab_size if cfg.tokenizer.kind == "bpe" else None
    model_vocab = cfg.model.vocab_size if isinstance(cfg.model, NativeModelConfig) else None
    return cfg, vocab_size or model_vocab or bpe_vocab, note


def info(cfg: Config, vocab_size: int | None = None, devices: int | None = None) -> dict[str, Any]:
    """Model size, training FLOPs per token and a per-device memory estimate for ``cfg`` on this host's
    devices, or on ``devices`` hypothetical ones (planning a pod from a laptop); the model and vocabulary as
    `planned` decides them."""
    cfg, vocab, note = planned(cfg, vocab_size)
    if devices is None:
        mesh = sharding.mesh_of(cfg.mesh)
    else:
        mesh = sharding.abstract_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices,
                                      context=cfg.mesh.context)
    spec = make_state_spec(cfg, vocab, mesh)
    mcfg = spec.model_cfg  # a native family's config, or a torchax model's ModelInfo
    compute_dtype = mcfg.compute_dtype
    trained_b = _bytes_per_device(spec.abstract.params)  # a LoRA run trains only its adapters
    params_b = trained_b + _bytes_per_device(spec.frozen_abstract)
    opt_b = _bytes_per_device(spec.abstract.opt_state)
    # sequences a step trains on per item of the batch: a preference pair 2, a GRPO prompt its completions
    per_item = cfg.data.kind.trained_per_item(cfg.objective)
    seq, batch = cfg.data.seq_len, cfg.train.batch_size * per_item // cfg.train.micro_batches
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = max(batch // dp, 1)
    act_item = np.dtype(compute_dtype).itemsize
    # Saved activations per layer ~ (34 D + 5 N T) bytes/token at 2 bytes (Korthikanti et al. 2022), scaled to
    # the compute dtype; full remat keeps only each layer's input, offload keeps even that in host memory.
    per_token_layer = (34 * mcfg.d_model + 5 * mcfg.n_head * seq) * act_item / 2
    if mcfg.remat in ("full", "offload"):
        per_token_layer = mcfg.d_model * act_item if mcfg.remat == "full" else 0
    split = mesh.shape["tensor"] * mesh.shape["context"]  # the context axis holds 1/context of each row's positions
    act_b = int(rows * seq * (mcfg.n_layer * per_token_layer + 4 * mcfg.vocab_size) / split)
    return {
        "params": mcfg.num_params(),
        "params_non_embedding": mcfg.num_params(non_embedding=True),
        "flops_per_token": mcfg.flops_per_token(seq),
        "flops_per_step": mcfg.flops_per_token(seq) * cfg.data.kind.trained_positions(
            cfg.train.batch_size, seq, cfg.objective, cfg.data.shares_prompts),
        "devices": math.prod(mesh.shape.values()),
        "mesh": dict(mesh.shape),
        "trainable_params": sum(math.prod(a.shape) for a in jax.tree.leaves(spec.abstract.params)),
        "memory_per_device": {"params": params_b, "grads": trained_b, "optimizer": opt_b, "activations": act_b,
                              "total": params_b + trained_b + opt_b + act_b},
        "model": mcfg,
        "note": note,
    }


def format_info(d: dict[str, Any]) -> str:
    gib = lambda b: f"{b / 2**30:.3f} GiB"
    m = d["memory_per_device"]
    return "\n".join([
        *([f"note:             {d['note']}"] if d.get("note") else []),
        f"model:            {d['model']}",
        (f"parameters:       {d['params']:,} ({d['params_non_embedding']:,} non-embedding; "
         f"{d['trainable_params']:,} trained)"),
        f"FLOPs per token:  {d['flops_per_token']:.3e} (training: 6N + attention; LoRA 4 per frozen weight)",
        f"FLOPs per step:   {d['flops_per_step']:.3e}",
        f"mesh:             {d['mesh']} over {d['devices']} device(s)",
        (f"memory / device:  params {gib(m['params'])}, grads {gib(m['grads'])}, optimizer {gib(m['optimizer'])}, "
         f"activations ~{gib(m['activations'])}; total ~{gib(m['total'])}"),
    ])
