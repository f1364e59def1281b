"""CPU forward+backward throughput of each native model family against transformers on the same weights.

For every family (gpt2, llama, qwen2, qwen3, mistral, gemma3; qwen3_moe when named in ``--families``: ``--experts``
of ``--moe-d-ff``, ``--top-k`` a token, every layer sparse, transformers' experts timed both as transformers 5 runs
them by default, ``grouped_mm``, and as its Python loop) a transformers model of one small shape is built
in fp32 (seeded), written with ``save_pretrained``, and read back natively with ``jaxtune.models.from_hf``, so
both sides hold identical weights. One measured step is a forward pass, mean next-token cross-entropy over the
(B, T, V) logits and gradients with respect to every parameter; no optimizer.

- jaxtune: ``jax.jit(jax.value_and_grad(loss))`` over the pure param dict (``nnx.split(model, nnx.Param)`` →
  ``nnx.to_pure_dict``; the loss merges the graphdef back), blocked with ``jax.block_until_ready``.
- transformers: ``model(input_ids).logits`` → ``F.cross_entropy`` → ``loss.backward()`` with the gradients set to
  None first, ``attn_implementation="eager"`` (and ``"sdpa"`` unless ``--no-sdpa``), ``loss.item()`` blocks.

Correctness is printed first: on the same batch the losses must agree to 1e-4 (relative) and so must the global
gradient norms; the script exits non-zero otherwise. Timing follows ``cpu_step.py``: after compiling and
warming up, every (family, implementation) pair runs once per round, all pairs interleaved in one process with
the order rotated each round, and the table reports medians (and the fastest step). XLA's CPU pool sizes itself
to the affinity mask; torch gets ``set_num_threads`` of the same count. The token ids start at 1 (see ``main``).
Usage:

    PYTHONPATH=src python benchmarks/models_cpu.py [--families gpt2,llama,...] [--steps 8] [--batch 4]
                                                   [--seq 256] [--threads N] [--no-sdpa] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import torch
import torch.nn.functional as F
import transformers
from _harness import add_common_args, first_call, interleave, pin_threads, print_header, run_record, timing_row
from flax import nnx

from jaxtune.models import from_hf

FAMILY_NAMES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe")
DEFAULT_FAMILIES = FAMILY_NAMES[:-1]  # the dense ones; --families qwen3_moe adds the mixture of experts
LOOP = "eager loop"  # qwen3_moe: eager attention and transformers' Python loop over the experts (not grouped_mm)
RTOL = 1e-4  # same weights and batch: losses and gradient norms agree to float32 reduction-order noise


# ---------------------------------------------------------------- the shape, per family
def hf_model(family: str, attn: str, shape: argparse.Namespace) -> torch.nn.Module:
    """A transformers fp32 causal LM of the benchmark shape, seeded so every attention variant has the same
    weights."""
    common = {"vocab_size": shape.vocab, "hidden_size": shape.d_model, "num_hidden_layers": shape.layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
              "intermediate_size": shape.d_ff, "max_position_embeddings": shape.max_pos, "attention_dropout": 0.0,
              "use_cache": False}
    if family == "gpt2":
        cls, cfg = transformers.GPT2LMHeadModel, transformers.GPT2Config(
            vocab_size=shape.vocab, n_positions=shape.max_pos, n_embd=shape.d_model, n_layer=shape.layers,
            n_head=shape.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=shape.vocab - 1, eos_token_id=shape.vocab - 1)  # n_inner: 4 D; 50256 is past the vocab
    elif family == "llama":
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    elif family == "qwen2":
        cls, cfg = transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common)
    elif family == "qwen3":
        cls, cfg = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common)
    elif family == "mistral":
        cls, cfg = transformers.MistralForCausalLM, transformers.MistralConfig(**common, sliding_window=shape.window)
    elif family == "qwen3_moe":  # every layer sparse; the experts as transformers 5 runs them by default (grouped_mm)
        cls, cfg = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **common, num_experts=shape.experts, num_experts_per_tok=shape.top_k, moe_intermediate_size=shape.moe_d_ff,
            norm_topk_prob=True)
    elif family == "gemma3":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape.layers)]
        cls, cfg = transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
            **common, sliding_window=shape.window, layer_types=types, query_pre_attn_scalar=shape.head_dim,
            final_logit_softcapping=None, attn_logit_softcapping=None)
    else:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILY_NAMES)}")
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if attn == LOOP else {}
    model = cls._from_config(cfg, attn_implementation="eager" if attn == LOOP else attn, dtype=torch.float32,
                             **experts)
    if family == "gemma3":  # Gemma's RMSNorm weights start at 0 (scale 1 + w): perturb them so they matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.1)
    return model.float().eval()  # eval: no dropout anywhere; autograd is unaffected


def hf_config_summary(model: torch.nn.Module) -> str:
    c = model.config
    keys = ("tie_word_embeddings", "sliding_window", "layer_types", "n_inner", "activation_function", "hidden_act",
            "hidden_activation", "query_pre_attn_scalar")
    return ", ".join(f"{k}={getattr(c, k)}" for k in keys if getattr(c, k, None) is not None)


# ---------------------------------------------------------------- the two steps
def make_jax_step(model: nnx.Module):
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)

    def loss_fn(p, x, y):
        logits = nnx.merge(graphdef, p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))

    def step(x, y, want_grad_norm=False):
        loss, grads = grad_fn(params, x, y)
        jax.block_until_ready((loss, grads))
        if want_grad_norm:
            return float(loss), float(optax.global_norm(grads))
        return float(loss)

    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    return step, n_params


def make_torch_step(model: torch.nn.Module):
    params = list(model.parameters())

    def step(x, y, want_grad_norm=False):
        for p in params:
            p.grad = None  # zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if want_grad_norm:
            norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None))
            return loss.item(), norm
        return loss.item()  # blocks

    return step


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                    help="comma-separated subset of " + ",".join(FAMILY_NAMES))
    ap.add_argument("--steps", type=int, default=8, help="timed rounds (each pair runs once per round; >= 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first (compiling) step")
    add_common_args(ap, batch=4, seq=256, layers=4, d_model=256, heads=4, kv_heads=2, d_ff=688, vocab=8192)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--max-pos", type=int, default=512)
    ap.add_argument("--window", type=int, default=128,
                    help="sliding window (mistral: every layer; gemma3: even layers)")
    ap.add_argument("--no-sdpa", action="store_true", help="skip the transformers sdpa rows")
    ap.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts a sparse layer")
    ap.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts a token")
    ap.add_argument("--moe-d-ff", type=int, default=344, help="qwen3_moe: an expert's d_ff (2 x 344 = d_ff active)")
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILY_NAMES]
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(FAMILY_NAMES)}")
    if args.steps < 5 or args.warmup < 1:
        ap.error("use at least 1 warm-up and 5 timed rounds")
    if args.seq + 1 > args.max_pos:
        ap.error("--seq must be below --max-pos")
    threads = pin_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    rng = np.random.RandomState(0)
    # Ids from 1: Gemma 3's pad_token_id is 0, and transformers builds its embedding with padding_idx=0, so torch
    # never sends a lookup gradient to row 0 while jaxtune does (the gradient of the function as written). A
    # batch holding id 0 then disagrees in that one row (2.4e3 vs 2.2 global grad norm at B=4, T=256).
    toks = rng.randint(1, args.vocab, (args.batch, args.seq + 1))
    x_np, y_np = toks[:, :-1], toks[:, 1:]
    x_j, y_j = jnp.asarray(x_np, jnp.int32), jnp.asarray(y_np, jnp.int32)
    x_t, y_t = torch.from_numpy(x_np.astype(np.int64)), torch.from_numpy(y_np.astype(np.int64))
    attns = ["eager"] + ([] if args.no_sdpa else ["sdpa"])

    # ---- build every (family, implementation) pair; compile / first step; correctness on the same batch
    impls: dict[tuple[str, str], dict] = {}
    info: dict[str, dict] = {}
    failures: list[str] = []
    for fam in families:
        try:
            variants = attns + ([LOOP] if fam == "qwen3_moe" else [])
            models = {a: hf_model(fam, a, args) for a in variants}
            with tempfile.TemporaryDirectory() as d:
                models["eager"].save_pretrained(d, safe_serialization=True)
                native = from_hf(d)
            jstep, n_params = make_jax_step(native)
            n_torch = sum(p.numel() for p in models["eager"].parameters())
            info[fam] = {"params": n_params, "torch_params": n_torch, "hf_config": hf_config_summary(models["eager"]),
                         "jaxtune_config": {k: getattr(native.cfg, k) for k in ("sliding_window", "layer_types",
                                                                                 "tie_embeddings")
                                            if hasattr(native.cfg, k)}}
            impls[(fam, "jaxtune")] = {"fn": lambda _, s=jstep: s(x_j, y_j),
                                       "check": lambda s=jstep: s(x_j, y_j, True)}
            for a in variants:
                tstep = make_torch_step(models[a])
                impls[(fam, f"hf {a}")] = {"fn": lambda _, s=tstep: s(x_t, y_t),
                                           "check": lambda s=tstep: s(x_t, y_t, True)}
        except Exception as e:  # noqa: BLE001  (report the family and go on with the others)
            failures.append(f"{fam}: setup failed: {type(e).__name__}: {e}")
            print(failures[-1], file=sys.stderr)
            for k in [k for k in impls if k[0] == fam]:
                del impls[k]
            continue
        for a in ["jaxtune"] + [f"hf {a}" for a in variants]:
            im = impls[(fam, a)]
            (im["loss"], im["grad_norm"]), im["first_step_s"] = first_call(im["check"])  # jaxtune: trace + compile

    run = interleave(impls, range(args.warmup + args.steps), timed=lambda r: r >= args.warmup)
    timed_s, load0, load1 = run["seconds"], run["load_before"], run["load_after"]

    # ---- report
    tokens = args.batch * args.seq
    rows = []
    for (fam, impl), im in impls.items():
        ref = impls[(fam, "hf eager")]
        rows.append({"family": fam, "implementation": impl, **timing_row(im, tokens),
                     "first_step_s": im["first_step_s"], "loss": im["loss"], "grad_norm": im["grad_norm"],
                     "loss_rel_diff_vs_eager": abs(im["loss"] - ref["loss"]) / abs(ref["loss"]),
                     "grad_norm_rel_diff_vs_eager": abs(im["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"])})
    by = {(r["family"], r["implementation"]): r for r in rows}

    print(f"shape: {args.layers} layers, d_model {args.d_model}, {args.heads} heads ({args.kv_heads} kv, gpt2 "
          f"{args.heads}), head_dim {args.head_dim}, d_ff {args.d_ff} (gpt2 {4 * args.d_model}), vocab {args.vocab}, "
          f"window {args.window} (mistral all layers, gemma3 even layers); qwen3_moe {args.experts} experts of "
          f"{args.moe_d_ff}, {args.top_k} a token; batch {args.batch} x seq {args.seq} = "
          f"{tokens} tokens/step, fp32; threads: XLA {threads} / torch {torch.get_num_threads()}; "
          f"{args.warmup} warm-up + {args.steps} timed rounds, all pairs interleaved ({timed_s:.0f} s); "
          f"load average {load0[0]:.1f} -> {load1[0]:.1f}")
    for fam in info:
        print(f"  {fam}: {info[fam]['params'] / 1e6:.2f}M params (torch {info[fam]['torch_params'] / 1e6:.2f}M); "
              f"{info[fam]['hf_config']}")
    print("correctness (same weights, same batch; relative to transformers eager):")
    bad = []
    for r in rows:
        print(f"  {r['family']:<8} {r['implementation']:<8} loss {r['loss']:.7f} (rel diff "
              f"{r['loss_rel_diff_vs_eager']:.1e})   grad norm {r['grad_norm']:.6f} (rel diff "
              f"{r['grad_norm_rel_diff_vs_eager']:.1e})")
        if r["loss_rel_diff_vs_eager"] > RTOL or r["grad_norm_rel_diff_vs_eager"] > RTOL:
            bad.append(f"{r['family']}/{r['implementation']}")

    sd = not args.no_sdpa
    # ms cells: median / fastest step. Under other people's load the fastest step is the closer estimate of the
    # uncontended cost, and its ratio ("best step") is printed beside the median one.
    head = ["family", "params", "jaxtune tok/s", "HF eager tok/s", "jaxtune / eager", "(best step)"]
    head += ["HF sdpa tok/s", "jaxtune / sdpa"] if sd else []
    head += ["jaxtune ms", "eager ms"] + (["sdpa ms"] if sd else []) + ["jaxtune CPU ms", "eager CPU ms", "compile s"]
    print_header(head)
    for fam in info:
        j, e = by[(fam, "jaxtune")], by[(fam, "hf eager")]
        cells = [fam, f"{info[fam]['params'] / 1e6:.2f}M", f"{j['tokens_per_s']:,.0f}", f"{e['tokens_per_s']:,.0f}",
                 f"**{j['tokens_per_s'] / e['tokens_per_s']:.2f}x**",
                 f"{e['ms_per_step_min'] / j['ms_per_step_min']:.2f}x"]
        if sd:
            s = by[(fam, "hf sdpa")]
            cells += [f"{s['tokens_per_s']:,.0f}", f"{j['tokens_per_s'] / s['tokens_per_s']:.2f}x"]
        cells += [f"{r['ms_per_step']:.0f} / {r['ms_per_step_min']:.0f}" for r in [j, e] + ([s] if sd else [])]
        cells += [f"{j['cpu_ms_per_step']:.0f}", f"{e['cpu_ms_per_step']:.0f}", f"{j['first_step_s']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    for fam in [f for f in info if (f, f"hf {LOOP}") in by]:
        j, loop = by[(fam, "jaxtune")], by[(fam, f"hf {LOOP}")]
        print(f"{fam}, transformers' loop over the experts (experts_implementation=eager): "
              f"{loop['tokens_per_s']:,.0f} tok/s, {loop['ms_per_step']:.0f} ms; jaxtune / loop "
              f"**{j['tokens_per_s'] / loop['tokens_per_s']:.2f}x**")
    for f in failures:
        print(f"FAILED {f}")

    result = run_record(jax=jax, jaxlib=jaxlib, flax=flax, optax=optax, torch=torch, transformers=transformers,
                        numpy=np) | {
        "config": vars(args) | {"threads": threads, "tokens_per_step": tokens,
                                "loadavg_before_after": [load0, load1], "timed_s": timed_s},
        "families": info, "rows": rows, "failures": failures}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if bad or failures:  # the timings would compare different computations (or none): fail loudly
        sys.exit(f"loss or gradient norm differs from transformers eager by more than {RTOL:g} (relative) for {bad}"
                 if bad else f"{len(failures)} families failed")
    return result


if __name__ == "__main__":
    main()
