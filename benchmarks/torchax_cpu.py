"""CPU full fine-tuning throughput of one HF Llama: jaxtune native vs jaxtune's torchax backend vs PyTorch eager
vs torchax's own training recipe.

One random Llama-architecture transformers model (fp32, seeded, untied head) is written with ``save_pretrained``
(safetensors) into a temp dir, and every side starts from it, so all train the same weights on the same batches:

- jaxtune native: ``model.from_hf=<dir>`` (jaxtune's Flax Llama, weights read from the checkpoint).
- jaxtune torchax: the same config with ``model.backend=torchax`` (the transformers module itself, run through
  torchax by ``torch.func.functional_call`` with JAX arrays as its weights; ``attn_implementation="sdpa"``).
  Both jaxtune sides are built exactly as ``train()`` builds them: ``make_state_spec`` → ``init`` /
  ``load_frozen`` → ``jit_steps`` (``jax.jit`` with explicit in/out shardings, the state donated, the
  (empty) frozen group as the third argument; under ``use_mesh``; batches through ``sharding.global_batch``.
- PyTorch eager: ``LlamaForCausalLM.from_pretrained(<dir>, attn_implementation="sdpa")`` with
  ``torch.optim.AdamW`` and ``clip_grad_norm_``.
- torchax recipe: ``torchax.train.make_train_step(model_fn, loss_fn, optax_optimizer)`` with ``model_fn`` a
  ``functional_call`` of another copy of the module over (weights, buffers) dicts of JAX arrays and ``loss_fn``
  torch's ``F.cross_entropy``. The step it returns is un-jitted (its own TODO says so): called as it comes, every
  torch op is dispatched eagerly through JAX under ``jax.value_and_grad``, and the optax update runs op by op. That
  row runs ``--recipe-steps`` steps per round (default 1: it is slow) and is labelled "un-jitted". The extra row
  "recipe + jax.jit" is the same step wrapped by hand in ``torchax.interop.jax_jit`` (weights and optimizer state
  donated): what a user gets from the recipe plus one line.

Optimizer everywhere: AdamW with the same lr, betas and eps, weight decay 0.1 on matrices only (ndim >= 2, as
jaxtune's ``decay_mask``), global-norm clipping at 1.0, constant lr. Loss everywhere: mean token cross-entropy over
the batch. Data: plain causal text windows (B, T) of random token ids, ``inputs``/``targets`` only: no packing, no
positions, no mask. The step-1 losses of all sides must agree (same weights, same batch); step-2 losses show that
the first update agrees too.

Timing as in ``lora_sft_cpu.py``: after the first (compiling) step and warm-up rounds, the implementations are
interleaved round by round in one process (order rotated every round), each round running ``--steps`` steps of
each (``--recipe-steps`` of the un-jitted recipe), every step blocked on its result; the table reports medians per
step. Other work on the machine hurts PyTorch most: with OMP_WAIT_POLICY unset, its OpenMP threads spin at every
barrier while a sibling thread is descheduled, so a loaded 2-core machine has been seen to make its eager step
3-10x slower (CPU time ~ wall time) while XLA's steps slowed far less; ``OMP_WAIT_POLICY=PASSIVE`` in the
environment (read when torch loads, so set it outside) or ``--threads 1`` avoids that. The report flags rows
whose median step is over 1.3x their fastest. ``--hlo-stats`` also compiles each jitted side once more and prints
XLA's cost analysis (FLOPs, bytes accessed) and its optimized HLO's size and op counts. Usage:

    [OMP_WAIT_POLICY=PASSIVE] PYTHONPATH=src python benchmarks/torchax_cpu.py
        [--rounds 6 --steps 2 --batch 8 --seq 256 --threads N] [--recipe-steps 1] [--no-recipe] [--no-recipe-jit]
        [--hlo-stats] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
import tempfile

import flax
import huggingface_hub
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import torch
import torch.nn.functional as F
import transformers
from _harness import (
    add_common_args,
    add_round_args,
    first_call,
    interleave,
    jaxtune_step,
    pin_threads,
    print_header,
    run_record,
    say_noisy,
    timing_row,
)

from jaxtune import sharding
from jaxtune.backends.torchax.compat import import_torchax
from jaxtune.config import load_config
from jaxtune.train.optim import decay_mask

LOSS_RTOL = 1e-5  # same weights and batch: step-1 losses agree to float32 reduction-order noise
NATIVE, TORCHAX, EAGER = "jaxtune native (jax.jit)", "jaxtune torchax (jax.jit)", "PyTorch eager (sdpa)"
RECIPE_JIT, RECIPE = "torchax recipe + jax.jit by hand", "torchax recipe, un-jitted"


# ---------------------------------------------------------------- model and data
def write_hf_model(directory: str, a: argparse.Namespace) -> int:
    """A seeded random fp32 LlamaForCausalLM of the benchmark shape, saved as safetensors; returns its params."""
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   head_dim=a.d_model // a.heads, intermediate_size=a.d_ff,
                                   max_position_embeddings=max(a.seq, 512), attention_dropout=0.0,
                                   tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def load_hf(directory: str) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    model.train()  # every dropout is 0
    return model


def text_batches(rng: np.random.RandomState, n: int, batch: int, seq: int, vocab: int) -> list[dict[str, np.ndarray]]:
    """``n`` (B, T) causal windows: ``inputs`` and next-token ``targets`` from seq + 1 random ids per row."""
    out = []
    for _ in range(n):
        toks = rng.randint(0, vocab, (batch, seq + 1))
        out.append({"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32)})
    return out


# ---------------------------------------------------------------- the steps
def jaxtune_side(cfg, host_batches):
    """One backend's step as ``train()`` builds and jits it: (step() -> loss, running the next batch; setup seconds;
    lowered() -> the jitted step lowered for abstract state, for --hlo-stats)."""
    js = jaxtune_step(cfg)
    spec, mesh, state, frozen, train_step, setup_s = (js[k] for k in ("spec", "mesh", "state", "frozen", "train_step",
                                                                       "setup_s"))
    batches = [sharding.global_batch(mesh, b) for b in host_batches]
    box = {"state": state, "i": 0}

    def step():
        with sharding.use_mesh(mesh):
            box["state"], metrics = train_step(box["state"], batches[box["i"]], frozen)
        jax.block_until_ready((box["state"], metrics))
        box["i"] += 1
        return float(metrics["loss"])

    def lowered():  # for --hlo-stats: abstract args (the live state is donated step by step)
        with sharding.use_mesh(mesh):
            return train_step.lower(spec.abstract, batches[0], frozen)

    return step, setup_s, lowered


def torch_optimizer(model: torch.nn.Module, ocfg) -> torch.optim.Optimizer:
    """AdamW as jaxtune's ``optim`` section: weight decay on matrices only (ndim >= 2)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": ocfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=ocfg.lr, betas=(ocfg.b1, ocfg.b2), eps=ocfg.eps)


def eager_side(directory: str, ocfg, torch_batches):
    model = load_hf(directory)
    opt = torch_optimizer(model, ocfg)
    box = {"i": 0}

    def step():
        x, y = torch_batches[box["i"]]
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if ocfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), ocfg.grad_clip)
        opt.step()
        box["i"] += 1
        return loss.item()  # blocks

    return step


def recipe_sides(directory: str, ocfg, host_batches, jit: bool, eager: bool):
    """torchax.train.make_train_step over one module: {name: step() -> loss} for the un-jitted step as it comes
    and (``jit``) the same step under ``interop.jax_jit`` with weights and optimizer state donated; plus the
    jitted step's lowering for --hlo-stats."""
    import_torchax()
    import torchax.train
    from torchax import interop

    model = load_hf(directory)
    weights0 = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    buffers = {n: jnp.asarray(b.numpy()) for n, b in model.named_buffers()}

    def model_fn(weights, buffers, args):  # torchax tensors in, torchax tensors out
        return torch.func.functional_call(model, {**weights, **buffers}, args=(),
                                          kwargs={"input_ids": args, "use_cache": False}).logits

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    adamw = optax.adamw(ocfg.lr, b1=ocfg.b1, b2=ocfg.b2, eps=ocfg.eps, weight_decay=ocfg.weight_decay,
                        mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(ocfg.grad_clip), adamw) if ocfg.grad_clip else adamw
    step = torchax.train.make_train_step(model_fn, loss_fn, tx)
    batches = [(jnp.asarray(b["inputs"]), jnp.asarray(b["targets"])) for b in host_batches]
    sides, lowered = {}, None

    def make(fn):
        box = {"w": jax.tree.map(jnp.copy, weights0), "o": None, "i": 0}
        box["o"] = tx.init(box["w"])

        def one():
            x, y = batches[box["i"]]
            loss, box["w"], box["o"] = fn(box["w"], buffers, box["o"], x, y)
            jax.block_until_ready(interop.jax_view((box["w"], box["o"], loss)))
            box["i"] += 1
            return float(interop.jax_view(loss))

        return one

    if jit:
        jitted = interop.jax_jit(step, kwargs_for_jax_jit={"donate_argnums": (0, 2)})
        sides[RECIPE_JIT] = make(jitted)
        jax_fn = jax.jit(interop.jax_view(step))  # the same function, for --hlo-stats (not donated)

        def lowered():
            w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), weights0)
            return jax_fn.lower(w, buffers, jax.eval_shape(tx.init, w), *batches[0])
    if eager:
        sides[RECIPE] = make(step)
    return sides, lowered


# ---------------------------------------------------------------- HLO statistics (--hlo-stats)
def hlo_stats(lowered) -> dict:
    """XLA's cost analysis (GFLOP, GB accessed), size and op counts of the optimized HLO of one step."""
    compiled = lowered.compile()
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = [^ ]+(?:\[[^\]]*\])?(?:\{[^}]*\})? ([\w\-]+)\(", line)
        if m:
            ops[m.group(1)] += 1
    keys = ("fusion", "dot", "convolution", "custom-call", "while", "copy", "transpose", "broadcast", "reduce",
            "scatter", "gather", "dynamic-slice", "dynamic-update-slice")
    return {"gflops": cost.get("flops", 0.0) / 1e9, "gbytes_accessed": cost.get("bytes accessed", 0.0) / 1e9,
            "hlo_chars": len(text), "instructions": sum(ops.values()),
            "fusions_defined": text.count("fused_computation"),
            "ops": {k: ops[k] for k in keys if ops[k]}}


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_round_args(ap, rounds=6)
    add_common_args(ap, batch=8, seq=256, layers=4, d_model=256, heads=4, kv_heads=2, d_ff=688, vocab=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--recipe-steps", type=int, default=1, help="steps per round of the un-jitted torchax recipe")
    ap.add_argument("--no-recipe", action="store_true", help="skip the un-jitted torchax recipe row")
    ap.add_argument("--no-recipe-jit", action="store_true", help="skip the torchax recipe + jax.jit row")
    ap.add_argument("--hlo-stats", action="store_true",
                    help="compile each jitted JAX side once more and print XLA's cost analysis and its optimized "
                         "HLO's size and op counts")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (~1-2 min on 2 cores): 3 rounds of 1 step, no warm-up round, batch 4")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.batch = 3, 1, 0, min(args.batch, 4)
    if args.rounds < 3 or args.steps < 1 or args.warmup < 0 or args.recipe_steps < 1:
        ap.error("use at least 3 timed rounds and 1 step per round")
    threads = pin_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()  # save_pretrained's and from_pretrained's shard bars

    n_rounds = args.warmup + args.rounds
    n_steps = 1 + n_rounds * max(args.steps, args.recipe_steps)  # batches per implementation, first step included
    host_batches = text_batches(np.random.RandomState(0), n_steps, args.batch, args.seq, args.vocab)
    torch_batches = [(torch.from_numpy(b["inputs"].astype(np.int64)), torch.from_numpy(b["targets"].astype(np.int64)))
                     for b in host_batches]

    tmp = tempfile.TemporaryDirectory()
    n_params = write_hf_model(tmp.name, args)
    overrides = [f"model.from_hf={tmp.name}", f"data.seq_len={args.seq}", f"train.batch_size={args.batch}",
                 f"train.steps={n_steps}", f"optim.lr={args.lr}", "optim.schedule=constant", "optim.warmup_steps=0"]
    cfg = load_config(None, overrides)
    ocfg = cfg.optim

    impls: dict[str, dict] = {}
    setup_s, lowerings = {}, {}
    for name, backend in ((NATIVE, "native"), (TORCHAX, "torchax")):
        c = load_config(None, overrides + [f"model.backend={backend}"])
        step, setup_s[name], lowerings[name] = jaxtune_side(c, host_batches)
        impls[name] = {"step": step, "steps": args.steps}
    impls[EAGER] = {"step": eager_side(tmp.name, ocfg, torch_batches), "steps": args.steps}
    recipes, recipe_lowered = recipe_sides(tmp.name, ocfg, host_batches, jit=not args.no_recipe_jit,
                                           eager=not args.no_recipe)
    if recipe_lowered is not None:
        lowerings[RECIPE_JIT] = recipe_lowered
    for name, step in recipes.items():
        impls[name] = {"step": step, "steps": args.recipe_steps if name == RECIPE else args.steps}

    for im in impls.values():
        im["fn"] = lambda _, st=im["step"], n=im["steps"]: [st() for _ in range(n)]
        im["first_loss"], im["first_step_s"] = first_call(im["step"])  # jitted sides: trace + XLA compile + run
    run = interleave(impls, range(n_rounds), timed=lambda r: r >= args.warmup)
    tmp.cleanup()

    stats = {name: hlo_stats(lower()) for name, lower in lowerings.items()} if args.hlo_stats else {}

    # ---- report (times are per round: per step below)
    tokens = args.batch * args.seq
    rows = []
    for name, im in impls.items():
        im["times"] = [t / im["steps"] for t in im["times"]]
        im["cpu"] = [c / im["steps"] for c in im["cpu"]]
        im["losses"] = [im["first_loss"]] + [x for out in im["outputs"] for x in out]
        rows.append({"implementation": name, **timing_row(im, tokens), "first_step_s": im["first_step_s"],
                     "timed_steps": len(im["times"]) * im["steps"], "loss_step1": im["losses"][0],
                     "loss_step2": im["losses"][1], "loss_last": im["losses"][-1], "steps_run": len(im["losses"])})
    by = {r["implementation"]: r for r in rows}
    ref = by[EAGER]
    for r in rows:
        for k in ("step1", "step2"):
            r[f"loss_{k}_rel_diff_vs_eager"] = abs(r[f"loss_{k}"] - ref[f"loss_{k}"]) / abs(ref[f"loss_{k}"])
        r["vs_eager"] = r["tokens_per_s"] / ref["tokens_per_s"]
        r["vs_native"] = r["tokens_per_s"] / by[NATIVE]["tokens_per_s"]

    load0, load1 = run["load_before"], run["load_after"]
    omp_wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"Llama (random, fp32, untied head): {args.layers} layers, hidden {args.d_model}, {args.heads} heads "
          f"({args.kv_heads} kv), intermediate {args.d_ff}, vocab {args.vocab}, {n_params / 1e6:.2f}M params; full "
          f"fine-tuning")
    print(f"data: plain causal windows, batch {args.batch} x seq {args.seq} = {tokens} tokens/step (no packing, no "
          f"positions, no mask); AdamW lr {ocfg.lr:g} betas ({ocfg.b1}, {ocfg.b2}) eps {ocfg.eps:g}, weight decay "
          f"{ocfg.weight_decay:g} on matrices, clip {ocfg.grad_clip}, constant lr; loss: mean token CE")
    print(f"threads: XLA {threads} / torch {torch.get_num_threads()} (OMP_WAIT_POLICY {omp_wait}); "
          f"first step + {args.warmup} warm-up round(s) + "
          f"{args.rounds} timed rounds of {args.steps} step(s) per implementation ({args.recipe_steps} for the "
          f"un-jitted recipe), interleaved ({run['seconds']:.0f} s); load average {load0[0]:.1f} -> {load1[0]:.1f}")
    print("jaxtune setup (state spec, weights read from the checkpoint, state init): "
          + ", ".join(f"{n.split(' (')[0]} {s:.1f} s" for n, s in setup_s.items()))
    print("correctness (same checkpoint, same batches; relative to PyTorch eager):")
    for r in rows:
        print(f"  {r['implementation']:<33} step-1 loss {r['loss_step1']:.7f} (rel diff "
              f"{r['loss_step1_rel_diff_vs_eager']:.1e})   step-2 {r['loss_step2']:.7f} (rel diff "
              f"{r['loss_step2_rel_diff_vs_eager']:.1e})   last (step {r['steps_run']}) {r['loss_last']:.5f}")
    print(f"  ln(vocab) = {math.log(args.vocab):.4f}")

    head = ["implementation", "tokens/s (median)", "ms/step (median / min)", "vs native", "vs PyTorch eager",
            "CPU ms/step", "first step (s)", "timed steps"]
    print_header(head)
    for r in rows:
        cells = [r["implementation"], f"{r['tokens_per_s']:,.0f}",
                 f"{r['ms_per_step']:.0f} / {r['ms_per_step_min']:.0f}", f"{r['vs_native']:.2f}x",
                 f"{r['vs_eager']:.2f}x", f"{r['cpu_ms_per_step']:.0f}", f"{r['first_step_s']:.1f}",
                 str(r["timed_steps"])]
        print("| " + " | ".join(cells) + " |")
    ratios = {"torchax_vs_native": by[TORCHAX]["tokens_per_s"] / by[NATIVE]["tokens_per_s"],
              "torchax_vs_eager": by[TORCHAX]["vs_eager"], "native_vs_eager": by[NATIVE]["vs_eager"]}
    if RECIPE_JIT in by:
        ratios["torchax_vs_recipe_jit"] = by[TORCHAX]["tokens_per_s"] / by[RECIPE_JIT]["tokens_per_s"]
    if RECIPE in by:
        ratios["torchax_vs_recipe_unjitted"] = by[TORCHAX]["tokens_per_s"] / by[RECIPE]["tokens_per_s"]
    print("\n" + ", ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))
    say_noisy(rows, load1[0])
    if stats:
        print("\noptimized HLO of one step (a second compile, --hlo-stats):")
        for name, s in stats.items():
            print(f"  {name:<33} {s['gflops']:.1f} GFLOP, {s['gbytes_accessed']:.1f} GB accessed, "
                  f"{s['hlo_chars'] / 1e3:.0f}k chars, "
                  f"{s['instructions']} instructions, {s['fusions_defined']} fused computations; "
                  + ", ".join(f"{k} {v}" for k, v in s["ops"].items()))

    result = run_record(jax=jax, jaxlib=jaxlib, flax=flax, optax=optax, torch=torch, transformers=transformers,
                        torchax=import_torchax(), numpy=np) | {
        "command": ("" if omp_wait == "unset" else f"OMP_WAIT_POLICY={omp_wait} ") + "PYTHONPATH=src "
                   + " ".join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])]),
        "config": vars(args) | {"threads": threads, "tokens_per_step": tokens, "params": n_params,
                                "loadavg_before_after": [load0, load1], "timed_s": run["seconds"],
                                "omp_wait_policy": omp_wait},
        "jaxtune_setup_s": setup_s, "ratios": ratios, "rows": rows, "hlo_stats": stats,
        "losses": {name: im["losses"] for name, im in impls.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    bad = [r["implementation"] for r in rows if r["loss_step1_rel_diff_vs_eager"] > LOSS_RTOL]
    if bad:  # the timings would compare different computations: fail loudly
        sys.exit(f"step-1 loss differs from PyTorch eager by more than {LOSS_RTOL:g} (relative) for {bad}")
    return result


if __name__ == "__main__":
    main()
