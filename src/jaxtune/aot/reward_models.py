"""The reward models of a GRPO or RLOO run (``objective.rewards`` entries ``name: model``) on a TPU slice: each one's
scoring program (`jaxtune.rollout.model_reward.last_token_scores`) compiled by libtpu for a step's completions, with
its weights placed on the policy's mesh as the run places them, and its memory per chip beside the training state
that stays resident while it scores."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune import sharding
from jaxtune.aot.step import Program
from jaxtune.backends import make_state_spec
from jaxtune.config import ConfigError
from jaxtune.models.sampling import bucket
from jaxtune.rollout.model_reward import last_token_scores
from jaxtune.run import run_config


def compile_reward_models(p: Program) -> list[dict[str, Any]]:
    """Each reward model's scoring program for a step's completions (train.batch_size x num_generations rows, up to
    the data-parallel degree; ``batch_size`` rows where the entry sets it) of the longest width the run can score (the
    policy's prompt and completion lengths, bucketed, at most the reward model's context): weights and program memory
    per chip, and with the training state resident whether it fits."""
    o, mesh = p.cfg.objective, p.mesh
    out = []
    for i, r in enumerate(o.rewards):
        if not r.model:
            continue
        started = time.perf_counter()
        try:
            cfg, tokenizer, _ = run_config(r.path)
        except ValueError as e:
            raise ConfigError(f"objective.rewards[{i}].path={r.path}: {str(e).removeprefix(f'{r.path}: ')}") from e
        spec = make_state_spec(cfg, tokenizer.vocab_size, mesh)
        weights = spec.weights(spec.abstract.params, spec.frozen_abstract)
        units = mesh.shape["data"] * mesh.shape["fsdp"]
        rows = -(-(r.batch_size or p.cfg.train.batch_size * o.num_generations) // units) * units
        width = min(bucket(p.cfg.max_prompt_tokens + o.max_completion_length), spec.model_cfg.max_seq_len)
        rows_sh = sharding.batch_sharding(mesh)
        tokens = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=rows_sh)
        last = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rows_sh)
        score = jax.jit(last_token_scores(spec.forward()), out_shardings=sharding.replicated(mesh))
        with sharding.use_mesh(mesh):
            compiled = score.lower(weights, tokens, last).compile()
        mem = compiled.memory_analysis()
        program = {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                   "temporaries": mem.temp_size_in_bytes, "code": mem.generated_code_size_in_bytes}
        weights_b = sum(sharding.shard_bytes(a) for a in jax.tree.leaves(weights))
        resident = sum(sharding.shard_bytes(a) for a in jax.tree.leaves((p.steps.spec.abstract,
                                                                          p.steps.abstract_frozen())))
        total = resident + program["arguments"] + program["outputs"] + program["temporaries"] + program["code"]
        out.append({"key": f"objective.rewards[{i}]", "path": r.path, "params": spec.model_cfg.num_params(),
                    "rows": rows, "width": width, "weights": weights_b, "program": program, "resident": resident,
                    "total": total, "fits": total <= p.slice.chip.hbm_usable,
                    "compile_seconds": time.perf_counter() - started})
    return out

