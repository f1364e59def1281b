"""GPT-2 124M pretraining step on one GPU: jaxtune's train step vs a nanoGPT-style PyTorch script written here.

- jaxtune: the ``gpt2-124m`` recipe (vocab 50304, seq 1024, float32 params, bf16 compute, AdamW (0.9, 0.95) with
  weight decay 0.1 on matrices, clipping at 1.0), built as ``train()`` builds it: ``make_state_spec`` → ``init`` →
  ``jit_steps`` (``jax.jit``, explicit shardings, state donated), via ``_harness.jaxtune_step``. Attention:
  ``model.attention=cudnn`` (``--attention``): `jax.nn.dot_product_attention(implementation="cudnn",
  is_causal=True)`, cuDNN's flash attention.
- PyTorch: `NanoGPT` below, the same architecture and shapes (LayerNorm, fused q/k/v, causal
  ``F.scaled_dot_product_attention(is_causal=True)`` (flash), tanh-GELU MLP, tied embeddings, nanoGPT's init),
  ``torch.compile`` (inductor), bf16 autocast over float32 weights, fused ``torch.optim.AdamW`` with the same
  hyper-parameters and weight-decay groups, ``clip_grad_norm_(1.0)``. TF32 on, as nanoGPT sets it. Both sides at
  the recipe's peak lr, constant (the recipe warms up over 715 steps).

Both train on the same random token batches (4 distinct ones, resident on the device, cycled). Each runs in its own
child process, one after the other (`_gpu`). MFU: ``flops_per_token`` of jaxtune's model config (6 N + 12 L D T,
N = non-embedding params + the tied head) times tokens/s over the GPU's peak dense bf16 FLOP/s from jaxtune's table
(`jaxtune.train.metrics.PEAK_FLOPS`, vendor datasheets: H100 SXM and H200 989 TFLOP/s); a GPU not in it gets no MFU.

``--batch 0`` searches: jaxtune's step is run at batch 8, 16, 32 ... (``--max-batch``) until it runs out of
memory, and both sides then use the largest that ran (halved again for both if PyTorch runs out). Each new batch
is one more compile, so ``run_all.sh`` passes ``--batch 64`` (llm.c's batch for this model on an 80 GB H100).

``--tiny``: 2 layers, d 64, vocab 512, seq 64, float32, batch 2 (through the search), 3 steps, XLA attention, and
``torch.compile(backend="eager")`` (Dynamo's graph capture without inductor's C++/Triton code generation, which
takes tens of seconds on a CPU). Usage:

    PYTHONPATH=src python benchmarks/gpu/gpt2_pretrain.py [--batch 64] [--warmup 5 --steps 20] [--json out.json]
    PYTHONPATH=src python benchmarks/gpu/gpt2_pretrain.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # benchmarks/: _harness
import _gpu as g
import _harness as h

JAX, TORCH = "jaxtune", "pytorch"
LABELS = {JAX: "jaxtune (jax.jit)", TORCH: "PyTorch nanoGPT-style (torch.compile)"}
FULL = {"layers": 12, "d_model": 768, "heads": 12, "vocab": 50304, "seq": 1024}
TINY = {"layers": 2, "d_model": 64, "heads": 4, "vocab": 512, "seq": 64}
N_BATCHES = 4  # distinct batches, cycled


def shape(a: argparse.Namespace) -> dict[str, int]:
    return TINY if a.tiny else FULL


# ---------------------------------------------------------------- jaxtune
def jaxtune_config(a: argparse.Namespace, batch: int) -> Any:
    from jaxtune.config import load_config

    s = shape(a)
    return load_config("gpt2-124m", [
        f"model.n_layer={s['layers']}", f"model.d_model={s['d_model']}", f"model.n_head={s['heads']}",
        f"model.vocab_size={s['vocab']}", f"model.max_seq_len={s['seq']}", f"data.seq_len={s['seq']}",
        f"model.compute_dtype={a.dtype}", f"model.attention={a.attention}", f"train.batch_size={batch}",
        "train.micro_batches=1", "optim.schedule=constant", "optim.warmup_steps=0"])


def jaxtune_side(a: argparse.Namespace) -> dict[str, Any]:
    s, cfg = shape(a), jaxtune_config(a, a.batch)
    js = h.jaxtune_step(cfg)
    row = g.time_jaxtune(js, g.random_tokens(0, N_BATCHES, a.batch, s["seq"], s["vocab"]), a.warmup, a.steps)
    return {"implementation": f"jaxtune (jax.jit, {cfg.model.attention} attention)", **row,
            "flops_per_token": js["spec"].model_cfg.flops_per_token(s["seq"]), "attention": cfg.model.attention,
            "compute_dtype": cfg.model.compute_dtype}


def find_batch(a: argparse.Namespace) -> dict[str, Any]:
    """The largest batch (doubling from ``--min-batch`` to ``--max-batch``) at which jaxtune's step runs twice."""
    import jax

    from jaxtune import sharding

    s = shape(a)
    js = h.jaxtune_step(jaxtune_config(a, a.min_batch))
    state, tries, fits = js["state"], [], None
    b = a.min_batch
    with sharding.use_mesh(js["mesh"]):
        while b <= a.max_batch:
            batch = sharding.global_batch(js["mesh"], g.random_tokens(0, 1, b, s["seq"], s["vocab"])[0])
            try:
                for _ in range(2):
                    state, _ = js["train_step"](state, batch, js["frozen"])
                jax.block_until_ready(state)
            except Exception as e:  # running out of memory ends the search; anything else is a failure
                if not g.is_oom(e):
                    raise
                tries.append({"batch": b, "fits": False})
                break
            tries.append({"batch": b, "fits": True})
            fits, b = b, 2 * b
    print(f"batch search: {tries}", flush=True)
    return {"batch": fits, "tries": tries}


# ---------------------------------------------------------------- PyTorch
def torch_modules():
    """The nanoGPT-style model, defined when torch is imported (only in its own side)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int):
            super().__init__()
            self.heads = heads
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):  # (B, T, D)
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, N, T, H)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class NanoGPT(nn.Module):
        def __init__(self, layers: int, d: int, heads: int, vocab: int, seq: int):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied
            for name, p in self.named_parameters():  # nanoGPT's init; residual projections scaled by depth
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx, targets):  # (B, T) ids -> mean next-token loss
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    return NanoGPT


def pytorch_side(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    device, name = g.torch_device()
    g.torch_threads(a)
    s = shape(a)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = torch_modules()(s["layers"], s["d_model"], s["heads"], s["vocab"], s["seq"]).to(device)
    model.train()
    compiled = torch.compile(model, backend=a.compile_backend)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    batches = [{k: torch.from_numpy(v).long().to(device) for k, v in b.items()}
               for b in g.random_tokens(0, N_BATCHES, a.batch, s["seq"], s["vocab"])]
    bf16 = a.dtype == "bfloat16"

    def step(i: int) -> float:
        b = batches[i % N_BATCHES]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = compiled(b["inputs"], b["targets"])
        return g.torch_update(loss, params, opt, device)

    graphs = {}
    timing = g.timed(step, a.warmup, a.steps, lambda m: graphs.__setitem__(m, g.dynamo_graphs()))
    return {"implementation": LABELS[TORCH] if a.compile_backend == "inductor"
            else f"PyTorch nanoGPT-style (torch.compile backend={a.compile_backend})",
            "device": name, **timing, "torch_compile": {"backend": a.compile_backend, "first_step": graphs["first"],
                                                         "end": graphs["end"]},
            "compiles_first_step": graphs["first"]["graphs"],
            "compiles_after_first_step": graphs["end"]["graphs"] - graphs["first"]["graphs"],
            **g.torch_peak_memory(device), "attention": "F.scaled_dot_product_attention(is_causal=True)",
            "compute_dtype": "bfloat16 autocast" if bf16 else "float32"}


SIDES = {JAX: jaxtune_side, TORCH: pytorch_side, "find-batch": find_batch}


# ---------------------------------------------------------------- the parent
def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g.add_args(ap, warmup=5, steps=20, batch=0)
    ap.add_argument("--min-batch", type=int, default=8, help="--batch 0: the search's first batch")
    ap.add_argument("--max-batch", type=int, default=512, help="--batch 0: the search's last batch")
    ap.add_argument("--attention", choices=["cudnn", "xla", "auto"], default="cudnn", help="jaxtune's model.attention")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype, both sides")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    args = g.parse_args(ap, argv, warmup=0, steps=2, min_batch=2, max_batch=2, attention="auto", dtype="float32",
                        compile_backend="eager")
    if args.side:
        g.run_child(args, SIDES)
        return {}

    s = shape(args)
    jax_skip = g.missing("jax", "flax", "optax")
    sides = {JAX: {"skip": jax_skip, "jax": True}, TORCH: {"skip": g.missing("torch"), "jax": False}}
    sides = g.select_sides(ap, args, sides)
    script = os.path.abspath(__file__)
    batch, search = args.batch, None
    if not batch:
        if jax_skip:
            sys.exit(f"--batch 0 searches with jaxtune's step, and {jax_skip}: pass --batch")
        search = g.spawn(script, argv, "find-batch", args.min_batch, jax_on_device=True)
        if not search.get("batch"):
            sys.exit(f"batch search failed: {search}")
        batch = search["batch"]

    result: dict[str, Any] = {"benchmark": "gpt2_pretrain", "tiny": args.tiny, "shape": s,
                              "versions": g.versions("jax", "jaxlib", "flax", "optax", "torch", "numpy"),
                              "args": {k: v for k, v in vars(args).items() if k not in ("side", "side_out")},
                              "batch_search": search}

    def save(rows: dict[str, Any], b: int) -> None:
        result.update(batch=b, tokens_per_step=b * s["seq"], rows=[{"side": k, **v} for k, v in rows.items()],
                      complete=len(rows) == len(sides))
        g.dump(args.json, result)

    rows, batch = g.run_sides(script, argv, sides, batch, save)
    tokens = batch * s["seq"]
    jx = rows.get(JAX, {})
    flops, peak = jx.get("flops_per_token"), jx.get("peak_flops")
    for r in rows.values():
        if not g.status(r):
            r["tokens_per_s"] = tokens / (r["ms_per_step"] / 1e3)
            r["mfu"] = flops * r["tokens_per_s"] / peak if flops and peak else None
    torch_tps = rows.get(TORCH, {}).get("tokens_per_s")
    result["mfu_note"] = (f"MFU: {flops:.4g} FLOPs/token (jaxtune's flops_per_token) over {peak / 1e12:.0f} TFLOP/s "
                          f"({jx.get('device')}, dense bf16)" if flops and peak else
                          f"MFU omitted: the peak FLOP/s of {jx.get('device', 'this device')!r} is not in jaxtune's "
                          "table (jaxtune.train.metrics.PEAK_FLOPS)")
    save(rows, batch)

    print(f"\nGPT-2 {s['layers']} layers, d {s['d_model']}, {s['heads']} heads, vocab {s['vocab']}, seq {s['seq']}; "
          f"batch {batch} ({tokens:,} tokens/step), {args.dtype} compute; first step + {args.warmup} warm-up + "
          f"{args.steps} timed steps per side, each side in its own process; device: "
          f"{jx.get('device') or rows.get(TORCH, {}).get('device')}")
    if search:
        print(f"batch search (jaxtune): {search['tries']}")
    print(result["mfu_note"])
    head = ["implementation", "tokens/s", "ms/step (median / min)", "MFU", "vs PyTorch", "first step (s)",
            "compile (s)", "compiles (first step / after)", "peak memory (GB)", "loss first / last"]
    g.print_rows(head, rows, LABELS, lambda r: [
        r["implementation"], g.fmt(r["tokens_per_s"]), f"{r['ms_per_step']:.1f} / {r['ms_per_step_min']:.1f}",
        g.fmt(r["mfu"] and 100 * r["mfu"], ".1f") + ("%" if r["mfu"] else ""),
        g.fmt(torch_tps and r["tokens_per_s"] / torch_tps, ".2f") + ("x" if torch_tps else ""),
        f"{r['first_step_s']:.1f}", f"{r['compile_s']:.1f}",
        f"{r['compiles_first_step']} / {r['compiles_after_first_step']}", f"{r['peak_mem_gb']:.2f}",
        f"{r['loss_first']:.4f} / {r['loss_last']:.4f}"])
    print("compiles: jaxtune = XLA compilations (jax.monitoring), PyTorch = graphs Dynamo compiled; compile (s) = "
          "first step - median step. peak memory: " + ", ".join(
              f"{r['implementation']}: {r['peak_mem_source']}" for r in rows.values() if not g.status(r)))
    failed = [k for k, r in rows.items() if g.status(r) and not r.get("skipped")]
    if failed:
        sys.exit(f"side(s) without a result: {failed}")
    return result


if __name__ == "__main__":
    main()
