"""The decoder-only transformer that Llama, Qwen, Mistral and Gemma 3 share: RMSNorm, rotary positions,
grouped-query attention, gated MLP. A family is a `DecoderConfig` (its file says how it differs) and an HF
name map; the math lives here once.

Shapes: B batch, T query length, S key length (cache), D d_model, N query heads, K key/value heads, H head dim,
F d_ff, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.models.family import RuntimeConfig
from jaxtune.models.layers import (
    Dense,
    Embed,
    KVCache,
    LoraSpec,
    MaskSpec,
    RMSNorm,
    Rope,
    ScoreHead,
    apply_rope,
    attention,
    attention_mask,
    cached_attention,
    constrain,
    dropout,
    head_scores,
    kv_cache,
    no_lm_head,
    residual_fence,
    run_layers,
    stack_layers,
    write_kv,
)
from jaxtune.models.moe import MoE

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}
LAYER_TYPES = ("full", "sliding")


@dataclass(frozen=True)
class DecoderConfig(RuntimeConfig):
    family: str = "llama"
    vocab_size: int = 32000
    max_seq_len: int = 2048
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None  # default n_head (multi-head); fewer: grouped-query attention
    head_dim: int | None = None  # default d_model // n_head; Gemma decouples it
    d_model: int = 64
    d_ff: int = 256
    norm_eps: float = 1e-5
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w)
    qkv_bias: bool = False  # Qwen 2.5
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen 3, Gemma 3: RMSNorm over each head's q and k before RoPE
    sandwich_norm: bool = False  # Gemma 3: also normalise the attention and MLP outputs before the residual add
    mlp_act: str = "silu"  # silu (SwiGLU) | gelu_tanh (GeGLU)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(d_model)
    tie_embeddings: bool = True
    rope: Rope = Rope()  # noqa: RUF009 (a frozen record: one shared default is safe)
    local_rope: Rope | None = None  # sliding-window layers' RoPE when it differs (Gemma 3: base 10k)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer full|sliding; None: all sliding if a window is set
    query_scale: float | None = None  # attention scale; default head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    init_std: float = 0.02
    pad_id: int | None = None
    lora: LoraSpec | None = None  # adapters on the projections it targets (q k v o gate up down)
    # 0: the language-model head; 1: a score head instead (HF's *ForSequenceClassification with one label: a reward
    # model), whose weights train with LoRA's adapters
    num_labels: int = 0
    # A mixture of experts (Qwen3-MoE): n_experts > 0 makes every layer's MLP a sparse block (`jaxtune.models.moe`)
    # of n_experts experts of moe_d_ff, experts_per_token of them per token, except the layers in dense_layers,
    # which keep the dense MLP of d_ff; norm_topk_prob renormalises the chosen experts' weights to sum to 1
    n_experts: int = 0
    experts_per_token: int = 0
    moe_d_ff: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # the router's load-balancing loss weight a checkpoint asks for (transformers' router_aux_loss_coef with
    # output_router_logits on): not computed yet, so a training run refuses it (`jaxtune.backends.native`)
    router_aux_loss: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}")
        if self.head_dim is None and self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                             "set model.head_dim")
        if self.mlp_act not in ACTIVATIONS:
            raise ValueError(f"mlp activation {self.mlp_act!r}; supported: {sorted(ACTIVATIONS)}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types must list {self.n_layer} entries of {LAYER_TYPES}, "
                                 f"got {self.layer_types}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding layers need a sliding_window")
        if self.n_experts:
            if not 0 < self.experts_per_token <= self.n_experts or self.moe_d_ff <= 0:
                raise ValueError(f"a mixture of experts needs 0 < experts_per_token <= n_experts and moe_d_ff > 0, got "
                                 f"{self.experts_per_token} of {self.n_experts} experts of {self.moe_d_ff}")
            if self.scan_layers and len(set(self.sparse)) > 1:
                raise ValueError(f"model.scan_layers=true stacks alike layers, but layers {list(self.dense_layers)} "
                                 "have a dense MLP and the others experts; set model.scan_layers=false")
            expert_targets = sorted({"gate", "up", "down"} & set(self.lora.targets if self.lora else ()))
            if expert_targets and any(self.sparse):
                raise ValueError(f"model.lora.targets: {', '.join(expert_targets)} would adapt the experts, which "
                                 "LoRA does not reach yet (adapters per expert are to come); target the attention "
                                 "(model.lora.targets=[q,k,v,o])")

    @property
    def needs_key(self) -> bool:
        """Whether training draws random numbers (dropout, LoRA dropout)."""
        return self.dropout > 0 or (self.lora is not None and self.lora.dropout > 0)

    def lora_on(self, name: str) -> LoraSpec | None:
        return None if self.lora is None else self.lora.on(name)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def sparse(self) -> tuple[bool, ...]:
        """Per layer: whether its MLP is a mixture of experts."""
        return tuple(bool(self.n_experts) and i not in self.dense_layers for i in range(self.n_layer))

    @property
    def types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return self.layer_types
        return ("sliding" if self.sliding_window else "full",) * self.n_layer

    def num_params(self, non_embedding: bool = False, active: bool = False) -> int:
        """Parameters; ``active``: a mixture of experts counts only the experts one token reaches (its FLOPs')."""
        d, f, n, k, h = self.d_model, self.d_ff, self.n_head, self.kv_heads, self.hd
        attn = d * (n + 2 * k) * h + n * h * d + (self.qkv_bias and (n + 2 * k) * h) + (self.o_bias and d)
        mlp = 3 * d * f + (self.mlp_bias and 2 * f + d)
        norms = (4 if self.sandwich_norm else 2) * d + (2 * h if self.qk_norm else 0)
        embed = self.vocab_size * d * (1 if self.tie_embeddings or self.num_labels else 2) + d * self.num_labels
        per_layer = [attn + norms + (self._experts(active) if sparse else mlp) for sparse in self.sparse]
        total = sum(per_layer) + d + embed
        return total - (embed if non_embedding else 0)

    def _experts(self, active: bool) -> int:
        e, k = self.n_experts, self.experts_per_token
        return self.d_model * e + 3 * (k if active else e) * self.d_model * self.moe_d_ff

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per trained matmul weight (forward, input and weight gradients), 4 per frozen
        one (no weight gradient: LoRA's base and head; 2 for the first layer's q, k and v, whose input needs no
        gradient either), the head counted (the vocabulary's, or a score head's), plus 12 L (N H) T attention, sliding
        layers counting only their window; a mixture of experts counts its router and the experts a token reaches.
        With LoRA, 6N would count gradients the step never computes (a plan's MFU then passed 100%)."""
        d = self.d_model
        head = d * self.num_labels if self.num_labels else self.vocab_size * d
        n = self.num_params(non_embedding=True, active=True) + head
        span = sum(min(seq_len, self.sliding_window) if t == "sliding" else seq_len for t in self.types)
        attention = 12 * self.n_head * self.hd * span
        if self.lora is None:
            return 6 * n + attention
        shapes = {"q": (d, self.n_head * self.hd), "k": (d, self.kv_heads * self.hd),
                  "v": (d, self.kv_heads * self.hd), "o": (self.n_head * self.hd, d), "gate": (d, self.d_ff),
                  "up": (d, self.d_ff), "down": (self.d_ff, d)}
        targets = self.lora.targets
        adapters = self.n_layer * sum(self.lora.rank * (i + o) for t, (i, o) in shapes.items() if t in targets)
        trained_head = head if self.num_labels else 0  # a score head trains beside the adapters
        # the first layer's q, k and v read the frozen embeddings: no gradient flows back through them
        first = d * (self.n_head + 2 * self.kv_heads) * self.hd
        return 4 * n - 2 * first + 2 * trained_head + 6 * adapters + attention


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        pd, cd = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        d, n, k, h = cfg.d_model, cfg.n_head, cfg.kv_heads, cfg.hd
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        kw = {"rngs": rngs, "std": cfg.init_std, "param_dtype": pd, "dtype": cd, "formulation": cfg.formulation}
        self.q = Dense(d, n * h, ("embed", "heads"), bias=cfg.qkv_bias, lora=cfg.lora_on("q"), **kw)
        self.k = Dense(d, k * h, ("embed", "kv_heads"), bias=cfg.qkv_bias, lora=cfg.lora_on("k"), **kw)
        self.v = Dense(d, k * h, ("embed", "kv_heads"), bias=cfg.qkv_bias, lora=cfg.lora_on("v"), **kw)
        self.o = Dense(n * h, d, ("heads", "embed"), bias=cfg.o_bias, lora=cfg.lora_on("o"), **{**kw, "std": out_std})
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, eps=cfg.norm_eps, offset=cfg.norm_offset, param_dtype=pd, dtype=cd)
            self.k_norm = RMSNorm(h, eps=cfg.norm_eps, offset=cfg.norm_offset, param_dtype=pd, dtype=cd)
        self.cfg = cfg

    def __call__(self, x, rope, mask, kv, index, key=None):
        """key: LoRA dropout (None: none)."""
        cfg, cd = self.cfg, jnp.dtype(self.cfg.compute_dtype)
        b, t, _ = x.shape
        kq, kk, kv_, ko = _keys(key, 4)
        q = self.q(x, kq).reshape(b, t, cfg.n_head, cfg.hd)
        k = self.k(x, kk).reshape(b, t, cfg.kv_heads, cfg.hd)
        v = self.v(x, kv_).reshape(b, t, cfg.kv_heads, cfg.hd)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = constrain(apply_rope(q, cos, sin), ("batch", "seq", "act_heads", None))
        k = constrain(apply_rope(k, cos, sin), ("batch", "seq", "act_kv_heads", None))
        impl = None if cfg.attention == "auto" else cfg.attention
        if kv is not None:
            kv, k, v = write_kv(kv, k, v, index)
            y = cached_attention(q, k.astype(cd), v.astype(cd), mask, impl, scale=cfg.query_scale,
                                 softcap=cfg.attn_softcap)
        else:
            y = attention(q, k, v, mask, impl, scale=cfg.query_scale, softcap=cfg.attn_softcap,
                          formulation=cfg.formulation)
        return self.o(y.reshape(b, t, cfg.n_head * cfg.hd), ko), kv


def _keys(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    return [None] * n if key is None else list(jax.random.split(key, n))


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        pd, cd = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        kw = {"rngs": rngs, "std": cfg.init_std, "bias": cfg.mlp_bias, "param_dtype": pd, "dtype": cd,
              "formulation": cfg.formulation}
        self.gate = Dense(cfg.d_model, cfg.d_ff, ("embed", "mlp"), lora=cfg.lora_on("gate"), **kw)
        self.up = Dense(cfg.d_model, cfg.d_ff, ("embed", "mlp"), lora=cfg.lora_on("up"), **kw)
        self.down = Dense(cfg.d_ff, cfg.d_model, ("mlp", "embed"), lora=cfg.lora_on("down"),
                          **{**kw, "std": cfg.init_std / math.sqrt(2 * cfg.n_layer)})
        self.act = ACTIVATIONS[cfg.mlp_act]

    def __call__(self, x, key=None):
        """key: LoRA dropout (None: none)."""
        kg, ku, kd = _keys(key, 3)
        y = constrain(self.act(self.gate(x, kg)) * self.up(x, ku), ("batch", "seq", "act_mlp"))
        return self.down(y, kd)


def sparse_mlp(cfg: DecoderConfig, rngs: nnx.Rngs) -> MoE:
    """A layer's mixture of experts (`jaxtune.models.moe`), drawn as the dense MLP would be."""
    return MoE(cfg.d_model, cfg.moe_d_ff, cfg.n_experts, cfg.experts_per_token, cfg.norm_topk_prob, rngs=rngs,
               act=ACTIVATIONS[cfg.mlp_act], std=cfg.init_std, out_std=cfg.init_std / math.sqrt(2 * cfg.n_layer),
               param_dtype=jnp.dtype(cfg.param_dtype), dtype=jnp.dtype(cfg.compute_dtype), formulation=cfg.formulation)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, index: int = 0):
        """``index``: the layer's place in the stack (which MLP it has, in a mixture of experts)."""
        pd, cd = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)

        def norm():
            return RMSNorm(cfg.d_model, eps=cfg.norm_eps, offset=cfg.norm_offset, param_dtype=pd, dtype=cd)

        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = sparse_mlp(cfg, rngs) if cfg.sparse[index] else MLP(cfg, rngs=rngs)
        if cfg.sandwich_norm:
            self.post_attn_norm = norm()
            self.post_mlp_norm = norm()
        self.cfg = cfg

    def __call__(self, x, rope, mask, key=None, kv=None, index=None):
        cfg = self.cfg
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        # LoRA dropout keys: folded from the layer key, so the residual dropout stream is the same with or without
        lora_drop = key is not None and cfg.lora is not None and cfg.lora.dropout > 0
        k_lora_attn, k_lora_mlp = ((jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)) if lora_drop
                                   else (None, None))
        x = residual_fence(x)
        y, kv = self.attn(self.attn_norm(x), rope, mask, kv, index, k_lora_attn)
        if cfg.sandwich_norm:
            y = self.post_attn_norm(y)
        x = residual_fence(constrain(x + dropout(y, cfg.dropout, k_attn), ("batch", "seq", "act_embed")))
        y = self.mlp(self.mlp_norm(x), k_lora_mlp)
        if cfg.sandwich_norm:
            y = self.post_mlp_norm(y)
        return constrain(x + dropout(y, cfg.dropout, k_mlp), ("batch", "seq", "act_embed")), kv


class Decoder(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        pd, cd = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), rngs=rngs, std=cfg.init_std,
                           param_dtype=pd, dtype=cd, formulation=cfg.formulation)
        self.layers = stack_layers(lambda r, i: DecoderLayer(cfg, rngs=r, index=i), cfg.n_layer, cfg.scan_layers,
                                   rngs)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, offset=cfg.norm_offset, param_dtype=pd, dtype=cd)
        if cfg.num_labels:
            self.score = ScoreHead(cfg.d_model, cfg.num_labels, rngs=rngs, std=cfg.init_std, param_dtype=pd, dtype=cd)
        elif not cfg.tie_embeddings:
            # (V, D) like the embedding, not a (D, V) Dense: XLA:CPU computes the weight gradient of a (D, V)
            # head through a transposed copy of the logits gradient that falls back to a slow dot (~15% of a step)
            self.lm_head = Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), rngs=rngs, std=cfg.init_std,
                                 param_dtype=pd, dtype=cd, formulation=cfg.formulation)

    def __call__(self, tokens, positions=None, key=None, cache=None, index=None, key_valid=None, segment_ids=None,
                 return_hidden=False, branch_ids=None, branch_slots=None):
        """tokens: (B, T) int -> logits (B, T, V) float32 (the same interface as `GPT`).

        positions: (B, T) RoPE positions, default 0..T-1. key: dropout key. cache: a `KVCache`
        written at slot ``index``, returns (logits, cache). key_valid: (B, S) real-token key slots.
        segment_ids: (B, T) packed sequences. return_hidden: final normalised hidden states instead of logits.
        branch_ids: (B, T) completions after a shared prompt; branch_slots: (B, G, C), rows in regions: a prompt,
        then G completions of C slots (`jaxtune.models.layers.MaskSpec`).
        """
        cfg = self.cfg
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.embed(tokens)
        if cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(cfg.d_model), jnp.dtype(cfg.param_dtype)).astype(x.dtype)
        if key is not None:
            key, k_embed = jax.random.split(key)
            x = dropout(x, cfg.dropout, k_embed)
        x = constrain(x, ("batch", "seq", "act_embed"))

        types = cfg.types
        spec = MaskSpec.of_forward(t, cache, index, key_valid=key_valid, segment_ids=segment_ids,
                                   branch_ids=branch_ids, positions=positions, branch_slots=branch_slots)
        full_rope = cfg.rope.sincos(positions, cfg.hd)
        # the kernel's masks are static per layer kind: a scan over layers of both kinds takes the dense one
        blocks = cfg.attention == "splash" and not (cfg.scan_layers and len(set(types)) > 1)
        ctx = {"full": (full_rope, attention_mask(spec, blocks))}
        if "sliding" in types:
            local_rope = full_rope if cfg.local_rope is None else cfg.local_rope.sincos(positions, cfg.hd)
            ctx["sliding"] = (local_rope, attention_mask(dataclasses.replace(spec, window=cfg.sliding_window), blocks))

        if cfg.scan_layers:
            if len(ctx) > 1 and ctx["full"][1] is None:  # one traced body for both kinds: materialise the mask
                ctx["full"] = (full_rope, attention_mask(dataclasses.replace(spec, explicit=True)))
            layer_args = [kind == "sliding" for kind in types]

            def body(layer, x, k, kv, sliding):
                if len(ctx) == 1:
                    rope, mask = next(iter(ctx.values()))
                else:
                    rope, mask = jax.tree.map(lambda a, b: jnp.where(sliding, a, b), ctx["sliding"], ctx["full"])
                return layer(x, rope, mask, k, kv, index)
        else:
            layer_args = list(types)

            def body(layer, x, k, kv, kind):
                rope, mask = ctx[kind]
                return layer(x, rope, mask, k, kv, index)

        x, cache = run_layers(self.layers, x, body, n_layer=cfg.n_layer, scan=cfg.scan_layers, remat=cfg.remat,
                              key=key, cache=cache, layer_args=layer_args)
        x = self.norm(x)
        out = x if return_hidden else self.logits(x)
        return (out, cache) if cache is not None else out

    def scores(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states (..., D) -> float32 scores (...,) of a reward model's head (``num_labels`` 1)."""
        return head_scores(self, hidden)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states (..., D) -> float32 logits (..., V), soft-capped when the family does."""
        no_lm_head(self.cfg)
        y = (self.embed if self.cfg.tie_embeddings else self.lm_head).attend(hidden)
        y = y.astype(jnp.float32)
        if self.cfg.final_softcap is not None:
            y = jnp.tanh(y / self.cfg.final_softcap) * self.cfg.final_softcap
        return constrain(y, ("batch", "seq", "act_vocab"))

    def init_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        cfg = self.cfg
        return kv_cache(cfg.n_layer, batch, length, cfg.kv_heads, cfg.hd, dtype or jnp.dtype(cfg.compute_dtype))
