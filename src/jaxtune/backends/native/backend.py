"""The native backend's model spec, forward, export and parity model."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxtune import sharding
from jaxtune.backends.base import ParityModel
from jaxtune.config import Config, ConfigError
from jaxtune.config.kinds import BRANCH_KEY, BRANCH_SLOTS_KEY
from jaxtune.models import FAMILIES, gguf_blocks, model_config
from jaxtune.models.hf import HFCheckpoint, export_pad_id, family_of, from_hf, load_params, read_hf_config, write_model
from jaxtune.models.lora import merge_adapters, write_adapter
from jaxtune.models.quantize import quantize_base, quantized_layout, streaming_quantizer
from jaxtune.models.registry import adapters, init_params, init_trained, merge, model_layout
from jaxtune.models.sampling import Generator
from jaxtune.models.unsupported import UnsupportedModelError
from jaxtune.train.logprobs import (
    chunked_token_logps,
    loss_chunk_size,
    tempered,
    token_logps,
    token_logps_and_entropy,
)
from jaxtune.train.objectives import initial_carry
from jaxtune.train.optim import Optimizer
from jaxtune.train.state import Batch, TrainState, init_state, state_layout


@dataclass(frozen=True)
class NativeForward:
    """A native model graph as functions of its weights (params, or (adapters, base) with LoRA)."""

    graphdef: nnx.GraphDef
    vocab_size: int
    loss_chunk: int = 0  # sequence positions per log-prob chunk (0: auto, see `loss_chunk_size`)

    def _run(self, weights: Any, batch: Batch, key: jax.Array | None, **kw: Any):
        model = merge(self.graphdef, weights)
        out = model(batch["inputs"], positions=batch.get("positions"), segment_ids=batch.get("segment_ids"),
                    branch_ids=batch.get(BRANCH_KEY), branch_slots=batch.get(BRANCH_SLOTS_KEY), key=key, **kw)
        return model, out

    def logits(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        return self._run(weights, batch, key)[1]

    def hidden(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        return self._run(weights, batch, key, return_hidden=True)[1]

    def token_logps(self, weights: Any, batch: Batch, key: jax.Array | None = None,
                    temperature: float = 1.0) -> jax.Array:
        return self._per_token(weights, batch, key, temperature, entropy=False)

    def scores(self, weights: Any, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        model, hidden = self._run(weights, batch, key, return_hidden=True)
        return model.scores(hidden)

    def token_logps_and_entropy(self, weights: Any, batch: Batch, key: jax.Array | None = None,
                                temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
        return self._per_token(weights, batch, key, temperature, entropy=True)

    def _per_token(self, weights: Any, batch: Batch, key: jax.Array | None, temperature: float, entropy: bool):
        b, t = batch["inputs"].shape
        positions = sharding.sharded("seq")  # a length the context axis does not divide stays whole
        split = (sharding.sharded("batch"), positions if t % positions == 0 else 1, sharding.sharded("act_vocab"))
        chunk = loss_chunk_size(b, t, self.vocab_size, self.loss_chunk, split)
        if chunk >= t:  # (B, T, V) float32 logits
            logits = tempered(self._run(weights, batch, key)[1], temperature)
            return (token_logps_and_entropy if entropy else token_logps)(logits, batch["targets"])
        model, hidden = self._run(weights, batch, key, return_hidden=True)
        head = lambda h: tempered(model.logits(h), temperature)
        return chunked_token_logps(head, hidden, batch["targets"], chunk, entropy)


@dataclass(frozen=True)
class NativeSpec:
    model_cfg: Any  # the family config (GPTConfig, DecoderConfig)
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    mesh: Mesh
    shardings: TrainState
    abstract: TrainState
    from_hf: str | None = None  # initial weights: this HuggingFace checkpoint instead of the family's init
    frozen_abstract: tuple = ()
    frozen_shardings: tuple = ()
    # QLoRA (``model.quantize``): the kind, and the base's layout before quantization (what a checkpoint reads into)
    quantize: str | None = None
    base_layout: tuple = ()
    gguf_plan: Any = None  # model.quantize=gguf: where each adapted kernel's blocks are in the file
    carry: dict = field(default_factory=dict)  # the objective's initial carry (`TrainState.carry`)
    optimizer: Optimizer | None = None  # what made tx and lr_schedule; formulation 1: the train program's inputs

    def init(self, seed: int) -> TrainState:
        """A fresh state, created sharded (each device computes or reads only its own shards)."""
        cfg, tx = self.model_cfg, self.tx
        params = None
        if self.from_hf and not self.frozen_abstract:  # full fine-tuning starts from the checkpoint
            params = self._read_hf(self.abstract.params, self.shardings.params)
        elif self.frozen_abstract:  # LoRA: the adapters (and a reward model's head) alone, op by op
            params = jax.device_put(jax.device_get(init_trained(cfg, seed)), self.shardings.params)  # every host's
            if self.from_hf and "score" in self.abstract.params:  # a reward model's head from the checkpoint
                params = {**params, **self._read_hf({"score": self.abstract.params["score"]},
                                                    {"score": self.shardings.params["score"]})}

        def make(params):
            if params is None:
                params = init_params(cfg, seed)[0]
            if "score" in self.abstract.params and "score" not in params:  # a causal LM's weights: a fresh head
                params = {**params, "score": init_params(cfg, seed)[0]["score"]}
            return init_state(params, tx, seed, self.carry)

        with sharding.use_mesh(self.mesh):
            return jax.jit(make, out_shardings=self.shardings)(params)

    def load_frozen(self, seed: int) -> tuple:
        """The frozen params, placed on the mesh: the checkpoint's (``from_hf``) or the seed's initial ones."""
        if not self.frozen_abstract:
            return ()
        if self.quantize == "gguf":  # QLoRA on the file's own blocks; the rest of the base as without quantize
            def rest(tree: Any, tree_sh: Any) -> Any:
                ckpt = HFCheckpoint(self.from_hf)
                return load_params(gguf_blocks.Without(ckpt, self.gguf_plan.hf_names), family_of(ckpt.config), tree,
                                   tree_sh)

            with sharding.use_mesh(self.mesh):
                return (gguf_blocks.load_base(self.gguf_plan, self.frozen_abstract[0], self.frozen_shardings[0],
                                              rest),)
        if self.quantize:  # QLoRA: each adapted kernel quantized as it is read (or, from the seed, after init)
            abstract, shardings = self.base_layout
            with sharding.use_mesh(self.mesh):
                if self.from_hf:
                    quantize = streaming_quantizer(self.frozen_abstract[0], self.frozen_shardings[0], self.quantize)
                    return (self._read_hf(abstract, shardings, quantize),)
                base = jax.jit(lambda: init_params(self.model_cfg, seed)[1], out_shardings=shardings)()
                quantize = functools.partial(quantize_base, self.abstract.params, kind=self.quantize)
                return (jax.jit(quantize, out_shardings=self.frozen_shardings[0], donate_argnums=0)(base),)
        if self.from_hf:
            return (self._read_hf(self.frozen_abstract[0], self.frozen_shardings[0]),)
        with sharding.use_mesh(self.mesh):
            return jax.jit(lambda: tuple(init_params(self.model_cfg, seed)[1:]),
                           out_shardings=self.frozen_shardings)()

    @staticmethod
    def weights(params: Any, frozen: tuple) -> Any:
        """What `jaxtune.models.registry.merge` takes: ``params``, or (adapters, base) with LoRA."""
        return (params, *frozen) if frozen else params

    def forward(self, loss_chunk: int = 0) -> NativeForward:
        return NativeForward(self.graphdef, self.model_cfg.vocab_size, loss_chunk)

    def generator(self) -> Generator:
        """The KV-cache sampler for eval prompts, `jaxtune generate` and GRPO; with LoRA it samples the model
        without adapters from weights with the adapters merged in (measured faster: benchmarks/RESULTS.md)."""
        lora = adapters(self.model_cfg)
        windowed = bool(getattr(self.model_cfg, "sliding_window", None))
        if self.quantize:  # QLoRA: merging would dequantize the whole base; the adapters run on it instead
            return Generator(self.graphdef, self.model_cfg.max_seq_len, windowed=windowed)
        plain = None if lora is None else model_layout(dataclasses.replace(self.model_cfg, lora=None), None)[0]
        return Generator(self.graphdef, self.model_cfg.max_seq_len, None if lora is None else (plain, lora),
                         windowed=windowed)

    def _read_hf(self, abstract: Any, shardings: Any, transform: Any = None) -> Any:
        """``abstract``'s params from the checkpoint. A reward model (a score head) reads a causal LM's weights
        without its LM head, its score head then fresh (left out of what this returns); and a sequence classifier's
        own score head where the tree has it (LoRA's base does not)."""
        ckpt = HFCheckpoint(self.from_hf)
        ignore: tuple[str, ...] = ()
        if getattr(self.model_cfg, "num_labels", 0):
            ignore = ("lm_head.weight",) if "score" in abstract else ("lm_head.weight", "score.weight")
            if "score" in abstract and "score.weight" not in ckpt.names():
                abstract, shardings = ({k: v for k, v in t.items() if k != "score"} for t in (abstract, shardings))
                if not abstract:  # only the head was asked for: LoRA's fresh one stays
                    return {}
        return load_params(ckpt, family_of(ckpt.config), abstract, shardings, transform, ignore)


def with_head(model_cfg: Any, cfg: Config) -> Any:
    """The family config with the head the objective trains: a score head (``num_labels`` 1) for a reward model (every
    native family has one); a sequence classifier's checkpoint refused for an objective that trains a language
    model."""
    head = cfg.objective.spec.head
    labels = getattr(model_cfg, "num_labels", 0)
    if head == "score" and not labels:
        return dataclasses.replace(model_cfg, num_labels=1)
    if head == "lm" and labels:
        raise ConfigError(f"model.from_hf={cfg.model.from_hf} is a reward model (a sequence classifier's score "
                          f"head, no language-model head); objective.name={cfg.objective.name} trains a language "
                          "model: start from a causal LM checkpoint")
    return model_cfg


class NativeBackend:
    name = "native"
    traces_in_threads = True

    def check_config(self, cfg: Config) -> None:
        """Every mesh layout applies (parameters are sharded by their logical axis names), but the splash kernel
        holds whole sequences on each device."""
        if cfg.model.attention == "splash" and cfg.mesh.context != 1:
            raise ConfigError(f"model.attention=splash with mesh.context={cfg.mesh.context}: the splash kernel "
                              "attends over whole sequences on each device; use model.attention=auto with the "
                              "context axis, or mesh.context=1 with the kernel")

    def build(self, cfg: Config, vocab_size: int | None, mesh: Mesh) -> NativeSpec:
        model_cfg = with_head(model_config(cfg.model, vocab_size), cfg)
        if getattr(model_cfg, "router_aux_loss", 0.0):
            raise ConfigError(f"model.from_hf={cfg.model.from_hf}: its config.json turns on the router's "
                              f"load-balancing loss (output_router_logits: true, router_aux_loss_coef "
                              f"{model_cfg.router_aux_loss:g}), which jaxtune does not compute yet; set "
                              "output_router_logits to false there to train without it, as transformers does by "
                              "default")
        optimizer = Optimizer(cfg.optim, cfg.optimizer_updates)
        tx = optimizer.tx()
        graphdef, abstract_groups, group_sh = model_layout(model_cfg, mesh, cfg.train.seed)
        carry = initial_carry(cfg.objective)
        shardings, abstract, frozen = state_layout(tx, abstract_groups, group_sh, mesh, cfg.train.seed, carry)
        frozen_sh, kind, base, plan = tuple(group_sh[1:]), cfg.model.quantize, (), None
        if kind == "gguf":  # QLoRA on the .gguf file's own blocks: their layout from its header
            base = (frozen[0], frozen_sh[0])
            plan = gguf_blocks.plan(gguf_blocks.gguf_file(cfg.model.from_hf), FAMILIES[model_cfg.family], model_cfg,
                                    abstract.params, frozen[0])
            quantized, placed = gguf_blocks.layout(plan, frozen[0], frozen_sh[0])
            frozen, frozen_sh = (quantized,), (placed,)
        elif kind:  # QLoRA: the base group as it is stored, quantized
            base = (frozen[0], frozen_sh[0])
            quantized, placed = quantized_layout(abstract.params, frozen[0], frozen_sh[0], kind)
            frozen, frozen_sh = (quantized,), (placed,)
        return NativeSpec(model_cfg, graphdef, tx, optimizer.schedule(), mesh, shardings,
                          abstract, cfg.model.from_hf, frozen, frozen_sh, kind, base, plan, carry, optimizer)

    def runs(self, config_json: dict[str, Any]) -> bool:
        try:
            family_of(config_json)
        except UnsupportedModelError:
            return False
        return True

    def export(self, run: Any, out: Path, *, tokenizer: Any, dtype: str | None, adapter: bool,
               max_shard_bytes: int, overwrite: bool, end_of_turn: tuple[int, ...] = ()) -> Path:
        """Merged (``W + scale A B``: an ordinary checkpoint), or with ``adapter`` a PEFT adapter directory."""
        cfg, params = run.spec.model_cfg, run.params
        lora = adapters(cfg)
        if adapter:
            if lora is None:
                raise ConfigError("--adapter: only a LoRA run (model.lora.rank > 0) has an adapter; export the full "
                                  "model")
            tokenizer_eos = tokenizer and tokenizer.eos_id
            pad = export_pad_id(cfg.pad_id, tokenizer and tokenizer.pad_id,
                                cfg.eos_id if cfg.eos_id is not None else tokenizer_eos,
                                score_head=bool(getattr(cfg, "num_labels", 0)),
                                stops=(cfg.eos_id, tokenizer_eos, *end_of_turn))
            return write_adapter(out, FAMILIES[cfg.family], lora, params, base_model=run.cfg.model.from_hf,
                                 tokenizer=tokenizer, overwrite=overwrite, end_of_turn=end_of_turn, eos=cfg.eos_id,
                                 pad_id=pad)
        if lora is not None:
            params, cfg = merge_adapters(params, run.frozen[0], lora), cfg.replace(lora=None)
        return write_model(cfg, params, out, tokenizer=tokenizer, dtype=dtype, max_shard_bytes=max_shard_bytes,
                           end_of_turn=end_of_turn)

    def parity_model(self, directory: Path) -> ParityModel:
        native = from_hf(directory, param_dtype="float32")
        graphdef, state = nnx.split(native, nnx.Param)
        params = nnx.to_pure_dict(state)
        generator = Generator(graphdef, read_hf_config(directory)[1].max_seq_len)
        return ParityModel(lambda tokens: native(jax.numpy.asarray(tokens)),
                           lambda prompts, n: generator(params, prompts, max_new_tokens=n).ids)


BACKEND = NativeBackend()
