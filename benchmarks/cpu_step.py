"""CPU train-step throughput: jaxtune's real GPT-2 train step vs a PyTorch GPT of identical architecture.

jaxtune side: the step exactly as ``train()`` builds it (``make_state_spec`` → ``jit_steps``: the objective's
loss, ``make_train_step``, ``jax.jit`` with explicit shardings, state donated, traced under ``use_mesh``). PyTorch
side: the same network written here (learned positions, pre-LayerNorm, fused qkv with bias, causal SDPA,
tanh-GELU MLP 4x, tied embeddings, no dropout) with the same AdamW (decay on matrices only), global-norm clipping and lr
schedule, started from the jaxtune parameters so the first-step losses must agree.

Timing: implementations are interleaved round by round (order rotated each round) in one process, every step
blocks on its result, and the table reports medians. Usage:

    PYTHONPATH=src python benchmarks/cpu_step.py [--layers 4 --d-model 256 --heads 4 --vocab 8192
                                                 --seq 256 --batch 8 --steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import flax
import jax
import jaxlib
import numpy as np
import optax
import torch
import torch.nn.functional as F
from _harness import (
    add_common_args,
    add_malloc_arg,
    first_call,
    interleave,
    pin_threads,
    run_record,
    timing_row,
    tune_malloc,
)
from torch import nn

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.train.objectives import make_objective
from jaxtune.train.reference import Frozen
from jaxtune.train.step import jit_steps

LOSS_RTOL = 1e-5  # same weights and batch: first-step losses agree to float32 reduction-order noise


# ---------------------------------------------------------------- PyTorch reference model (nanoGPT-style)
class TorchBlock(nn.Module):
    def __init__(self, d: int, n_head: int, ff: int, eps: float):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.qkv = nn.Linear(d, 3 * d)  # output features ordered (3, N, H) like jaxtune's (D, 3, N*H)
        self.attn_out = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.fc = nn.Linear(d, ff)
        self.proj = nn.Linear(ff, d)

    def forward(self, x):  # (B, T, D)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)  # (B, T, N, H)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT(nn.Module):
    def __init__(self, vocab: int, max_seq: int, n_layer: int, d: int, n_head: int, ff: int, eps: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList([TorchBlock(d, n_head, ff, eps) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d, eps=eps)

    def forward(self, tokens):  # (B, T) -> (B, T, V)
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)[None]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head


def load_jaxtune_params(model: TorchGPT, params) -> None:
    """Copy a jaxtune GPT params dict (host numpy) into the torch model."""

    def t(a):
        return torch.from_numpy(np.array(a, np.float32))  # a writable copy

    with torch.no_grad():
        model.wte.weight.copy_(t(params["wte"]["embedding"]))
        model.wpe.weight.copy_(t(params["wpe"]["embedding"]))
        model.ln_f.weight.copy_(t(params["ln_f"]["scale"]))
        model.ln_f.bias.copy_(t(params["ln_f"]["bias"]))
        for i, blk in enumerate(model.blocks):
            p = params["blocks"][i]
            d = p["qkv"].shape[0]
            blk.qkv.weight.copy_(t(np.asarray(p["qkv"]).reshape(d, -1).T))
            blk.qkv.bias.copy_(t(np.asarray(p["qkv_bias"]).reshape(-1)))
            for name in ("ln_1", "ln_2"):
                getattr(blk, name).weight.copy_(t(p[name]["scale"]))
                getattr(blk, name).bias.copy_(t(p[name]["bias"]))
            for name in ("attn_out", "fc", "proj"):
                getattr(blk, name).weight.copy_(t(np.asarray(p[name]["kernel"]).T))
                getattr(blk, name).bias.copy_(t(p[name]["bias"]))


def make_torch_optimizer(model: nn.Module, ocfg) -> torch.optim.Optimizer:
    """AdamW as jaxtune's ``optim`` section: weight decay on matrices only (ndim >= 2)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": ocfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=ocfg.lr, betas=(ocfg.b1, ocfg.b2), eps=ocfg.eps)


def make_torch_step(model: nn.Module, opt: torch.optim.Optimizer, grad_clip: float | None):
    def step(x, y, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        return loss.item()  # blocks

    return step


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, layers=4, d_model=256, heads=4, vocab=8192, seq=256, batch=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per implementation (>= 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per implementation after compiling")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    add_malloc_arg(ap)
    args = ap.parse_args(argv)
    if args.steps < 10 or args.warmup < 3:
        ap.error("use at least 3 warm-up and 10 timed steps")
    threads = pin_threads(args.threads)
    if args.malloc_arena:
        tune_malloc()
    torch.manual_seed(0)

    n_batches = args.warmup + args.steps + 1
    cfg = load_config(None, [f"model.n_layer={args.layers}", f"model.d_model={args.d_model}",
                             f"model.n_head={args.heads}", f"model.vocab_size={args.vocab}",
                             f"model.max_seq_len={args.seq}", f"data.seq_len={args.seq}",
                             f"train.batch_size={args.batch}", "model.dropout=0.0"])
    rng = np.random.RandomState(0)
    host_batches = []
    for _ in range(n_batches):
        toks = rng.randint(0, args.vocab, (args.batch, args.seq + 1))
        host_batches.append({"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32)})

    # jaxtune: the step exactly as train() builds and jits it.
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    spec = make_state_spec(cfg, args.vocab, mesh)
    state = spec.init(cfg.train.seed)
    init_params = jax.device_get(state.params)  # before the first step donates the state
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train)
    jax_batches = [sharding.global_batch(mesh, b) for b in host_batches]
    lrs = [float(spec.lr_schedule(i)) for i in range(n_batches)]

    # PyTorch: same weights, same optimizer, same batches.
    mc = spec.model_cfg
    torch_batches = [(torch.from_numpy(b["inputs"].astype(np.int64)), torch.from_numpy(b["targets"].astype(np.int64)))
                     for b in host_batches]

    def torch_impl(compiled: bool):
        model = TorchGPT(mc.vocab_size, mc.max_seq_len, mc.n_layer, mc.d_model, mc.n_head, mc.ff, mc.ln_eps)
        load_jaxtune_params(model, init_params)
        opt = make_torch_optimizer(model, cfg.optim)
        return make_torch_step(torch.compile(model) if compiled else model, opt, cfg.optim.grad_clip)

    impls: dict[str, dict] = {}
    load0 = os.getloadavg()
    with sharding.use_mesh(mesh):
        box = {"state": state}

        def jax_step(i):
            box["state"], metrics = steps.train(box["state"], jax_batches[i], Frozen())
            jax.block_until_ready((box["state"], metrics))
            return float(metrics["loss"])

        impls["jaxtune (jax.jit)"] = {"fn": jax_step}
        tstep = torch_impl(compiled=False)
        impls["PyTorch eager"] = {"fn": lambda i, s=tstep: s(*torch_batches[i], lrs[i])}
        if not args.no_compile:
            cstep = torch_impl(compiled=True)
            impls["PyTorch torch.compile"] = {"fn": lambda i, s=cstep: s(*torch_batches[i], lrs[i])}

        # Step 0 compiles (jit / inductor) and gives the first-step losses from identical weights.
        for im in impls.values():
            first, im["first_step_s"] = first_call(lambda im=im: im["fn"](0))
            im["outputs"] = [first]
        interleave(impls, range(1, n_batches), timed=lambda i: i > args.warmup)

    tokens = args.batch * args.seq
    ref_name = "PyTorch eager"
    ref_loss = impls[ref_name]["outputs"]
    rows = []
    for name, im in impls.items():
        losses = im["outputs"]
        rows.append({"implementation": name, **timing_row(im, tokens), "first_step_s": im["first_step_s"],
                     "loss_step1": losses[0], "loss_step2": losses[1], "loss_last": losses[-1]})
    ref_tps = next(r["tokens_per_s"] for r in rows if r["implementation"] == ref_name)
    for r in rows:
        r["ratio_vs_eager"] = r["tokens_per_s"] / ref_tps

    print(f"GPT: {mc.n_layer} layers, d_model {mc.d_model}, {mc.n_head} heads, vocab {mc.vocab_size}, "
          f"seq {args.seq}, batch {args.batch}, fp32, {mc.num_params() / 1e6:.2f}M params; "
          f"threads: XLA {threads} / torch {torch.get_num_threads()}; "
          f"{args.warmup} warm-up + {args.steps} timed steps each, interleaved; "
          f"malloc tuning {'on' if args.malloc_arena else 'off'}; "
          f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("correctness (same initial weights, same batch):")
    for r in rows:
        rel1 = abs(r["loss_step1"] - ref_loss[0]) / abs(ref_loss[0])
        rel2 = abs(r["loss_step2"] - ref_loss[1]) / abs(ref_loss[1])
        r["loss_step1_rel_diff_vs_eager"], r["loss_step2_rel_diff_vs_eager"] = rel1, rel2
        print(f"  {r['implementation']:<24} step-1 loss {r['loss_step1']:.7f} (rel diff {rel1:.1e})   "
              f"step-2 loss {r['loss_step2']:.7f} (rel diff {rel2:.1e})   last {r['loss_last']:.5f}")
    print(f"\n| {'implementation':<24} | {'tokens/s (median)':>17} | {'ms/step':>8} | {'vs PyTorch eager':>16} |"
          f" {'min ms/step':>11} | {'CPU ms/step':>11} | {'first step (s)':>14} |")
    print(f"|{'-' * 26}|{'-' * 18}:|{'-' * 9}:|{'-' * 17}:|{'-' * 12}:|{'-' * 12}:|{'-' * 15}:|")
    for r in rows:
        print(f"| {r['implementation']:<24} | {r['tokens_per_s']:>17,.0f} | {r['ms_per_step']:>8.1f} |"
              f" {r['ratio_vs_eager']:>15.2f}x | {r['ms_per_step_min']:>11.1f} | {r['cpu_ms_per_step']:>11.0f} |"
              f" {r['first_step_s']:>14.1f} |")
    bad = [r["implementation"] for r in rows if r["loss_step1_rel_diff_vs_eager"] > LOSS_RTOL]

    result = run_record(jax=jax, jaxlib=jaxlib, flax=flax, optax=optax, torch=torch, numpy=np) | {
        "config": vars(args) | {"threads": threads, "params": mc.num_params(),
                                "loadavg_before_after": [load0, os.getloadavg()]},
        "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if bad:  # the timings compare different computations: fail loudly
        sys.exit(f"first-step loss differs from PyTorch eager by more than {LOSS_RTOL:g} (relative) for {bad}")
    return result


if __name__ == "__main__":
    main()
