"""The torchax backend's model spec, sampler, export and parity model: the same `TrainState`, optimizer,
shardings and checkpoints as the native backend, with parameters keyed by the PyTorch module path and sharded by
shape (`fsdp_axes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtune import sharding
from jaxtune.backends.base import ParityModel
from jaxtune.backends.torchax.model import (
    ModelInfo,
    TorchaxModel,
    build_torch_model,
    flatten,
    fsdp_axes,
    merge_weights,
    to_torch,
)
from jaxtune.config import Config, ConfigError, TorchaxModelConfig
from jaxtune.io import atomic_dir
from jaxtune.models.fits import check_fits
from jaxtune.models.hf import export_pad_id, write_stop_tokens
from jaxtune.models.sampling import (
    Generation,
    Sampling,
    bucket,
    check_prompts,
    collect,
    row_logps,
    sample_logits,
    stop_tuple,
)
from jaxtune.train.logprobs import tempered, token_logps, token_logps_and_entropy
from jaxtune.train.objectives import initial_carry
from jaxtune.train.optim import Optimizer
from jaxtune.train.state import Batch, TrainState, init_state, state_layout


@dataclass(frozen=True)
class TorchaxForward:
    """A torchax model as functions of its merged weights (`merge_weights`)."""

    model: TorchaxModel

    def logits(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        return self.model.logits(weights, batch["inputs"], batch.get("positions"), key)

    def hidden(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        return self.model.hidden(weights, batch["inputs"], batch.get("positions"), key)

    def token_logps(self, weights: Any, batch: Batch, key: jax.Array | None = None,
                    temperature: float = 1.0) -> jax.Array:
        return token_logps(tempered(self.logits(weights, batch, key), temperature), batch["targets"])

    def scores(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        return self.model.scores(weights, batch["inputs"], batch.get("positions"), key)

    def token_logps_and_entropy(self, weights: Any, batch: Batch, key: jax.Array | None = None,
                                temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
        return token_logps_and_entropy(tempered(self.logits(weights, batch, key), temperature), batch["targets"])


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
    carry: dict = field(default_factory=dict)  # the objective's initial carry (`TrainState.carry`)
    optimizer: Optimizer | None = None  # what made tx and lr_schedule; formulation 1: the train program's inputs

    def init(self, seed: int) -> TrainState:
        """A fresh state from the module's weights (checkpoint or seeded init), placed shard by shard."""
        params = jax.device_put(self.host_params, self.shardings.params)
        with sharding.use_mesh(self.mesh):
            return jax.jit(lambda p: init_state(p, self.tx, seed, self.carry), out_shardings=self.shardings)(params)

    def load_frozen(self, seed: int) -> tuple:
        """(base,) with LoRA: re-read with the module (never checkpointed); () otherwise."""
        if self.host_frozen is None:
            return ()
        return (jax.device_put(self.host_frozen, self.frozen_shardings[0]),)

    weights = staticmethod(merge_weights)  # all of the model's weights as one nested dict (`TorchaxModel.logits`)

    def forward(self, loss_chunk: int = 0) -> TorchaxForward:
        """The HF model computes the full (B, T, V) logits (``train.loss_chunk`` applies to native models only)."""
        return TorchaxForward(self.model)

    def generator(self) -> TorchaxGenerator:
        return TorchaxGenerator(self.model, self.model_cfg.max_seq_len)


class TorchaxGenerator:
    """Sampling from a torchax model for eval prompts and `jaxtune generate`, without a KV cache: the whole
    (right-padded) buffer is run again for each new token, one compiled shape per (batch, buffer length). Causal
    attention keeps each row's tokens independent of the padding after them. Fine for samples; slow for long
    generations."""

    def __init__(self, model: TorchaxModel, max_seq_len: int):
        self.model = model
        self.max_seq_len = max_seq_len
        self.compiles = 0
        self._next = jax.jit(self._next_impl, static_argnames="sampling")

    def _next_impl(self, weights, tokens, lengths, key, *, sampling: Sampling):
        self.compiles += 1
        logits = self.model.logits(weights, tokens)  # (B, L, V)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        ids = sample_logits(last, key, sampling)
        return ids, token_logps(tempered(last.astype(jnp.float32), sampling.temperature or 1.0), ids)

    def __call__(self, weights: Any, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | list[int] | None = None,
                 seed: int = 0, on_step: Any = None, keep_stop: bool = False, group: int = 1,
                 draw: str = "cdf") -> Generation:
        """The new ids per prompt and each one's log-prob under the tempered distribution (`Generation`).
        ``group`` is a hint this sampler does not use: it recomputes every row's prefix at every token anyway."""
        max_new_tokens = check_prompts(prompts, self.max_seq_len, max_new_tokens)
        longest = max(len(p) for p in prompts)
        length = min(bucket(longest + max_new_tokens), self.max_seq_len)
        tokens = np.zeros((len(prompts), length), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        key, sampling, stops = jax.random.key(seed), Sampling.of(temperature, top_k, top_p, draw), stop_tuple(eos_id)
        out: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), bool)
        drawn = []  # (B,) log-probs per position
        for t in range(max_new_tokens):
            ids, logp = jax.device_get(self._next(weights, tokens, lengths, jax.random.fold_in(key, t),
                                                  sampling=sampling))
            drawn.append(logp)
            if collect(ids, out, done, stops, on_step, keep_stop) or t == max_new_tokens - 1:
                break
            tokens[np.arange(len(prompts)), lengths] = ids
            lengths = lengths + 1
        return Generation(out, row_logps(drawn, out))


class TorchaxBackend:
    name = "torchax"
    traces_in_threads = False

    def check_config(self, cfg: Config) -> None:
        if cfg.mesh.tensor != 1:
            raise ConfigError("mesh.tensor must be 1 with model.backend=torchax (its parameters are sharded by "
                              "shape over mesh.fsdp); use mesh.fsdp instead")
        if cfg.mesh.context != 1:
            raise ConfigError("mesh.context must be 1 with model.backend=torchax: context parallelism needs the "
                              "native model's attention (model.family gpt2/llama/qwen/mistral/gemma3)")
        if cfg.mesh.rollout:
            raise ConfigError("mesh.rollout must be 0 with model.backend=torchax: its sampler runs on the learner's "
                              "devices (objective.max_staleness still samples ahead there)")

    def build(self, cfg: Config, vocab_size: int | None, mesh: Mesh) -> TorchaxSpec:
        module = build_torch_model(cfg.model, cfg.train.seed, cfg.objective.spec.head)
        model = TorchaxModel(module, remat=cfg.model.remat, compute_dtype=cfg.model.compute_dtype)
        info = model.info
        check_fits(info.vocab_size, info.max_seq_len, tokenizer_vocab=vocab_size, max_seq_len=cfg.model.max_seq_len,
                   what="the model's embedding (max_position_embeddings)")
        if cfg.model.max_seq_len:
            info = ModelInfo(**{**info.__dict__, "max_seq_len": cfg.model.max_seq_len})
        trainable, frozen = model.initial(cfg.model.param_dtype)
        groups = [trainable] + ([frozen] if model.frozen_names else [])
        abstract_groups = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), g) for g in groups]
        fsdp = mesh.shape["fsdp"]
        group_sh = [jax.tree.map(lambda a: NamedSharding(mesh, P(*fsdp_axes(a.shape, fsdp))), g) for g in groups]
        optimizer = Optimizer(cfg.optim, cfg.optimizer_updates)
        tx = optimizer.tx()
        carry = initial_carry(cfg.objective)
        shardings, abstract, frozen_abstract = state_layout(tx, abstract_groups, group_sh, mesh, cfg.train.seed,
                                                            carry)
        return TorchaxSpec(info, model, tx, optimizer.schedule(), mesh, shardings, abstract,
                           trainable, frozen if model.frozen_names else None, frozen_abstract, tuple(group_sh[1:]),
                           carry, optimizer)

    def runs(self, config_json: dict[str, Any]) -> bool:
        """Any transformers causal LM (its ops must lower through torchax: checked when it first runs)."""
        return True

    def export(self, run: Any, out: Path, *, tokenizer: Any, dtype: str | None, adapter: bool,
               max_shard_bytes: int, overwrite: bool, end_of_turn: tuple[int, ...] = ()) -> Path:
        """As transformers writes models: the trained weights are copied into the PyTorch module, then
        ``save_pretrained`` (safetensors). LoRA: merged into the base (PEFT ``merge_and_unload``), or with
        ``adapter`` the PEFT adapter directory."""
        import torch

        model: TorchaxModel = run.spec.model
        lora = bool(model.frozen_names)
        if adapter and not lora:
            raise ConfigError("--adapter: only a LoRA run (model.lora.rank > 0) has an adapter; export the full model")
        weights = flatten(jax.device_get(run.weights))
        module = model.module
        c = model.base.config  # its pad id, config.json's, is the one the tokenizer names
        eos = [] if c.eos_token_id is None else [c.eos_token_id] if isinstance(c.eos_token_id, int) else c.eos_token_id
        tokenizer_eos = tokenizer and tokenizer.eos_id
        c.pad_token_id = export_pad_id(c.pad_token_id, tokenizer and tokenizer.pad_id, next(iter(eos), tokenizer_eos),
                                       score_head=run.cfg.objective.spec.head == "score",
                                       stops=(*eos, *end_of_turn, tokenizer_eos))
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(to_torch(weights[name]).to(p.dtype))

        def fill(tmp: Path) -> None:
            target = module if adapter or not lora else module.merge_and_unload()
            if dtype is not None and not adapter:
                target = target.to(getattr(torch, dtype))
            target.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_bytes)
            (tmp / "README.md").unlink(missing_ok=True)  # PEFT's placeholder model card: not ours to (over)write
            eos_id = write_stop_tokens(tmp, end_of_turn, [module.config.eos_token_id, tokenizer and tokenizer.eos_id])
            if tokenizer is not None:
                tokenizer.save(tmp, eos_id=eos_id, pad_id=c.pad_token_id)

        if jax.process_index() == 0:
            atomic_dir(out, fill)
        return out

    def parity_model(self, directory: Path) -> ParityModel:
        model = TorchaxModel(build_torch_model(TorchaxModelConfig(from_hf=str(directory)), 0))
        weights = model.initial()[0]
        logits = jax.jit(model.logits)
        generator = TorchaxGenerator(model, model.info.max_seq_len)
        return ParityModel(lambda tokens: logits(weights, tokens),
                           lambda prompts, n: generator(weights, prompts, max_new_tokens=n).ids)


BACKEND = TorchaxBackend()
