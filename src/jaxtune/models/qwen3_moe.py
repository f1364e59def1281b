"""Qwen3-MoE on the shared `Decoder`: Qwen 3's attention (RMSNorm over each head's q and k, no biases) and, in place
of the dense MLP, a mixture of experts (`jaxtune.models.moe`): ``num_experts`` experts of ``moe_intermediate_size``,
``num_experts_per_tok`` of them per token, their weights renormalised when ``norm_topk_prob``. The layers in
``mlp_only_layers``, and all but every ``decoder_sparse_step``-th, keep a dense MLP of ``intermediate_size``.

HF stores each expert's projections apart (``mlp.experts.{j}.gate_proj.weight``, as transformers writes them) and the
router as ``mlp.gate.weight``; jaxtune stacks the experts on a leading axis."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtune.models.decoder import Decoder, DecoderConfig
from jaxtune.models.decoder_hf import decoder_from_hf, decoder_hf_map, decoder_to_hf
from jaxtune.models.family import Family, Map
from jaxtune.models.layers import Rope
from jaxtune.models.qwen import sliding_fields
from jaxtune.models.unsupported import require

_Q3MOE = partial(DecoderConfig, family="qwen3_moe", qk_norm=True, norm_eps=1e-6, rope=Rope(theta=1e6), head_dim=128,
                 vocab_size=151936, max_seq_len=40960, bos_id=151643, eos_id=151645, tie_embeddings=False,
                 norm_topk_prob=True)
PRESETS = {
    # tests: GQA, dims that divide an 8-device mesh; 8 experts, 2 a token, the second layer dense
    "tiny": partial(_Q3MOE, vocab_size=512, max_seq_len=128, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                    head_dim=32, d_ff=128, n_experts=8, experts_per_token=2, moe_d_ff=32, dense_layers=(1,),
                    bos_id=None, eos_id=None),
    "qwen3-30b-a3b": partial(_Q3MOE, n_layer=48, n_head=32, n_kv_head=4, d_model=2048, d_ff=6144, n_experts=128,
                             experts_per_token=8, moe_d_ff=768),
    "qwen3-235b-a22b": partial(_Q3MOE, n_layer=94, n_head=64, n_kv_head=4, d_model=4096, d_ff=12288, n_experts=128,
                               experts_per_token=8, moe_d_ff=1536),
}

_E = "model.layers.{i}.mlp."


def hf_map() -> dict[str, Map]:
    """The dense decoder's names, plus the router and each expert's projections (transposed: HF's are (out, in))."""
    m = decoder_hf_map()
    m["layers.{i}.mlp.router.kernel"] = Map(_E + "gate.weight", transpose=True)
    for ours in ("gate", "up", "down"):
        m[f"layers.{{i}}.mlp.{ours}"] = Map(f"{_E}experts.{{j}}.{ours}_proj.weight", transpose=True, experts=True)
    return m


def from_hf(c: dict[str, Any]) -> DecoderConfig:
    require(c, "hidden_act", ("silu",), "qwen3_moe")
    bias = bool(c.get("attention_bias", False))
    n_layer, step = int(c["num_hidden_layers"]), int(c.get("decoder_sparse_step", 1))
    n_experts = int(c.get("num_experts", c.get("num_local_experts", 0)))
    only = set(c.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(n_layer) if not n_experts or i in only or (i + 1) % step)
    return decoder_from_hf(c, DecoderConfig, "qwen3_moe", qk_norm=True, qkv_bias=bias, o_bias=bias,
                           n_experts=n_experts, experts_per_token=int(c.get("num_experts_per_tok", 0)),
                           moe_d_ff=int(c.get("moe_intermediate_size", 0)),
                           norm_topk_prob=bool(c.get("norm_topk_prob", False)), dense_layers=dense,
                           router_aux_loss=float(c.get("router_aux_loss_coef", 0.001))
                           if c.get("output_router_logits") else 0.0)


def to_hf(cfg: DecoderConfig) -> dict[str, Any]:
    if not cfg.qk_norm or cfg.qkv_bias != cfg.o_bias:
        raise ValueError("a Qwen3-MoE config.json has q/k norm and the same bias on q/k/v/o")
    return decoder_to_hf(cfg, "qwen3_moe", "Qwen3MoeForCausalLM", attention_bias=cfg.qkv_bias, **sliding_fields(cfg),
                         num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                         moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
                         decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers),
                         output_router_logits=cfg.router_aux_loss > 0,
                         router_aux_loss_coef=cfg.router_aux_loss or 0.001)


FAMILY = Family("qwen3_moe", DecoderConfig, Decoder, PRESETS, ("qwen3_moe",), hf_map(), from_hf, to_hf,
                hf_ignore=("rotary_emb.inv_freq",))
