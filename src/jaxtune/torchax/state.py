"""The train state of a torchax model: the same `TrainState`, optimizer, shardings and checkpoints as the native
backend, with parameters keyed by the PyTorch module path and sharded by shape (`fsdp_axes`).

`TorchaxSpec` offers what `jaxtune.train.state.StateSpec` offers (the loop, evaluation and export use only that):
``init``, ``load_frozen``, ``weights``, ``loss_fn``, ``generator``, the abstract state and its shardings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtune.config import Config, ConfigError
from jaxtune.generate import sample_logits
from jaxtune.torchax.model import ModelInfo, TorchaxModel, build_torch_model, fsdp_axes, merge_weights
from jaxtune.train import sharding
from jaxtune.train.optim import make_optimizer, schedule
from jaxtune.train.step import LossFn, TrainState, init_state, weighted_cross_entropy


@dataclass(frozen=True)
class TorchaxSpec:
    model_cfg: ModelInfo
    model: TorchaxModel
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    mesh: Mesh
    shardings: TrainState
    abstract: TrainState
    host_params: Any  # the module's initial trainable weights (numpy, nested by module path)
    host_frozen: Any  # a LoRA model's base weights, else None
    frozen_abstract: tuple = ()
    frozen_shardings: tuple = ()

    def init(self, seed: int) -> TrainState:
        """A fresh state from the module's weights (checkpoint or seeded init), placed shard by shard."""
        params = jax.device_put(self.host_params, self.shardings.params)
        with sharding.use_mesh(self.mesh):
            return jax.jit(lambda p: init_state(p, self.tx, seed), out_shardings=self.shardings)(params)

    def load_frozen(self, seed: int) -> tuple:
        """(base,) with LoRA: re-read with the module (never checkpointed); () otherwise."""
        if self.host_frozen is None:
            return ()
        return (jax.device_put(self.host_frozen, self.frozen_shardings[0]),)

    def weights(self, params: Any, frozen: tuple) -> Any:
        """All of the model's weights as one nested dict (what `TorchaxModel.logits` takes)."""
        return merge_weights(params, frozen)

    def loss_fn(self, loss_chunk: int = 0) -> LossFn:
        """``(params, batch, key, frozen) -> (summed loss, counted tokens)``. The HF model computes the full
        (B, T, V) logits (``train.loss_chunk`` applies to native models only)."""
        model = self.model

        def loss(params, batch, key, frozen):
            targets = batch["targets"]
            weights = batch.get("loss_mask", jnp.ones(targets.shape, jnp.float32))
            logits = model.logits(merge_weights(params, frozen), batch["inputs"], batch.get("positions"), key)
            return weighted_cross_entropy(logits, targets, weights), jnp.sum(weights)

        return loss

    def generator(self) -> TorchaxGenerator:
        return TorchaxGenerator(self.model, self.model_cfg.max_seq_len)


def make_torchax_spec(cfg: Config, vocab_size: int | None, mesh: Mesh) -> TorchaxSpec:
    module = build_torch_model(cfg.model, cfg.train.seed)
    model = TorchaxModel(module, remat=cfg.model.remat, compute_dtype=cfg.model.compute_dtype)
    info = model.info
    if cfg.model.max_seq_len:
        if cfg.model.max_seq_len > info.max_seq_len:
            raise ConfigError(f"model.max_seq_len={cfg.model.max_seq_len} exceeds the model's "
                              f"max_position_embeddings {info.max_seq_len}")
        info = ModelInfo(**{**info.__dict__, "max_seq_len": cfg.model.max_seq_len})
    if vocab_size is not None and vocab_size > info.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} ids but the model's embedding only {info.vocab_size} rows; "
                          "use the model's tokenizer or a larger vocab_size in its config")
    trainable, frozen = model.initial(cfg.model.param_dtype)
    groups = [trainable] + ([frozen] if model.frozen_names else [])
    abstract_groups = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), g) for g in groups]
    fsdp = mesh.shape["fsdp"]
    group_sh = [jax.tree.map(lambda a: NamedSharding(mesh, P(*fsdp_axes(a.shape, fsdp))), g) for g in groups]
    from jaxtune.train.state import state_layout

    tx = make_optimizer(cfg.optim, cfg.train.steps)
    shardings, abstract, frozen_abstract = state_layout(tx, abstract_groups, group_sh, mesh, cfg.train.seed)
    return TorchaxSpec(info, model, tx, schedule(cfg.optim, cfg.train.steps), mesh, shardings, abstract,
                       trainable, frozen if model.frozen_names else None, frozen_abstract, tuple(group_sh[1:]))


class TorchaxGenerator:
    """Sampling from a torchax model for eval prompts and `jaxtune generate`, without a KV cache: the whole
    (right-padded) buffer is run again for each new token, one compiled shape per (batch, buffer length). Causal
    attention keeps each row's tokens independent of the padding after them. Fine for samples; slow for long
    generations."""

    def __init__(self, model: TorchaxModel, max_seq_len: int):
        self.model = model
        self.max_seq_len = max_seq_len
        self.compiles = 0
        self._next = jax.jit(self._next_impl, static_argnums=(4, 5, 6))

    def _next_impl(self, weights, tokens, lengths, key, temperature, top_k, top_p):
        self.compiles += 1
        logits = self.model.logits(weights, tokens)  # (B, L, V)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return sample_logits(last, key, temperature, top_k, top_p)

    def __call__(self, weights: Any, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | list[int] | None = None,
                 seed: int = 0, on_step: Any = None) -> list[list[int]]:
        from jaxtune.generate import bucket, collect

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        if longest >= self.max_seq_len:
            raise ValueError(f"generate: a prompt has {longest} tokens; the model's context is {self.max_seq_len}")
        max_new_tokens = min(max_new_tokens, self.max_seq_len - longest)
        length = min(bucket(longest + max_new_tokens), self.max_seq_len)
        tokens = np.zeros((len(prompts), length), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        key = jax.random.key(seed)
        sampling = (float(temperature), top_k, None if top_p is None else float(top_p))
        out: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), bool)
        for t in range(max_new_tokens):
            ids = np.asarray(self._next(weights, tokens, lengths, jax.random.fold_in(key, t), *sampling))
            if collect(ids, out, done, eos_id, on_step) or t == max_new_tokens - 1:
                break
            tokens[np.arange(len(prompts)), lengths] = ids
            lengths = lengths + 1
        return out


def export_run(run: Any, *, tokenizer: Any = None, dtype: str | None = None, adapter: bool = False,
               max_shard_bytes: int = 5_000_000_000) -> Any:
    """Write a torchax run (`jaxtune.evaluate.LoadedRun`) as transformers writes models: its trained weights are
    copied into the PyTorch module, then ``save_pretrained`` (safetensors). LoRA: merged into the base
    (PEFT ``merge_and_unload``), or with ``adapter`` the PEFT adapter directory. Returns a ``fill(directory)``
    for `jaxtune.models.hf.write_dir_atomically`."""
    import torch

    from jaxtune.torchax.model import flatten, to_torch

    model: TorchaxModel = run.spec.model
    lora = bool(model.frozen_names)
    if adapter and not lora:
        raise ConfigError("--adapter: only a LoRA run (model.lora.rank > 0) has an adapter; export the full model")
    weights = flatten(jax.device_get(run.weights))
    module = model.module
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(to_torch(weights[name]).to(p.dtype))

    def fill(tmp: Any) -> None:
        target = module if adapter or not lora else module.merge_and_unload()
        if dtype is not None and not adapter:
            target = target.to(getattr(torch, dtype))
        target.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save(tmp)

    return fill
