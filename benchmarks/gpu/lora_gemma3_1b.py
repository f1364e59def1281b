"""LoRA SFT on a Gemma-3-1B-shaped model on one GPU: jaxtune native vs transformers + PEFT vs jaxtune's torchax
backend.

The model: the ``gemma3-1b`` preset of jaxtune's gemma3 family (d 1152, 26 layers, 4 heads, 1 key/value head,
head_dim 256, ffn 6912, vocab 262144, sliding window 512 on five layers of six), randomly initialised (nothing is
downloaded); transformers gets it as the config.json jaxtune's own exporter writes (``FAMILIES["gemma3"].to_hf``).
LoRA rank 16, alpha 32 on q k v o gate up down; base frozen in bf16, adapters float32, bf16 compute; AdamW (lr 1e-4,
wd 0, constant lr), gradients clipped at 1.0.

- jaxtune native: ``make_state_spec`` → ``init`` (adapters) / ``load_frozen`` (base) → ``jit_steps``, as ``train()``
  builds it (``_harness.jaxtune_step``); its own initialisation. Attention ``model.attention=cudnn``: see "packed
  rows" below.
- transformers + PEFT: ``AutoModelForCausalLM.from_config(..., attn_implementation="sdpa")`` and
  ``peft.get_peft_model(LoraConfig(r, lora_alpha, target_modules=q_proj ... down_proj))``, built on the CPU in
  float32 from seed 0 as the torchax backend builds its module, then moved to the GPU with the base cast to bf16
  (the adapters stay float32, as PEFT keeps them over a bf16 base). Forward under ``torch.autocast(bfloat16)``; loss
  = mean cross-entropy of the float32 logits over the counted tokens (as transformers' own loss); fused
  ``torch.optim.AdamW`` over the adapters. Eager.
- jaxtune torchax: ``model.backend=torchax`` with ``model.hf_config`` = that config.json: the same PEFT-wrapped
  transformers module, run through JAX by torchax (its ``scaled_dot_product_attention`` is torchax's XLA reference),
  jitted by the same ``jit_steps``. Same weights as transformers + PEFT, so the two losses agree step for step (to
  bf16 rounding on a GPU; printed).

Packed rows: every (B, T) row is full and holds 3-8 examples, positions restarting at 0 in each, segment ids from
1, the loss on each example's second part (``_gpu.packed_rows``). jaxtune native gets ``segment_ids`` and
``positions``: its mask (same segment, causal, and the window on sliding layers) is a boolean (B, 1, T, S) array,
which `jax.nn.dot_product_attention(implementation="cudnn")` turns into an additive bias for cuDNN's fused
attention (cuDNN also returns that bias's gradient, unused). JAX 0.10's public `jax.nn.dot_product_attention` has
no segment-id or packed-offset argument: cuDNN's packed ("THD") layout is reachable only through the private
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(q_offsets=, kv_offsets=)``, whose kv offsets are
scaled by the query head count, wrong for grouped-query attention such as this model's 4:1 (fixed upstream in
jax-ml/jax#39521). transformers and torchax get ``position_ids`` (restarting) and no ``attention_mask``:
transformers detects the packing and builds the same block-diagonal causal mask, windowed on sliding layers. So
all three compute the same attention.

Each side runs in its own child process, one after the other (`_gpu`): the first step (trace + compile), warm-up,
then the median of ``--steps`` steps each ended by a device synchronisation. Peak memory: JAX
``memory_stats()["peak_bytes_in_use"]``, PyTorch ``torch.cuda.max_memory_allocated()``.

``--tiny``: the gemma3 ``tiny`` preset (2 layers (one sliding, window 16), d 64, 4 heads, 2 key/value heads,
vocab 512), seq 64, batch 2, float32, 3 steps, XLA attention. Usage:

    PYTHONPATH=src python benchmarks/gpu/lora_gemma3_1b.py [--batch 4] [--warmup 3 --steps 10] [--json out.json]
    PYTHONPATH=src python benchmarks/gpu/lora_gemma3_1b.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from typing import Any

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # benchmarks/: _harness
import _gpu as g
import _harness as h

NATIVE, HF, TORCHAX = "jaxtune", "hf-peft", "torchax"
LABELS = {NATIVE: "jaxtune native (jax.jit)", HF: "transformers + PEFT (sdpa, eager)",
          TORCHAX: "jaxtune torchax (jax.jit)"}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-4
N_BATCHES = 4  # distinct batches, cycled
# PEFT reads a transformers property that transformers 5 deprecates (both PEFT sides)
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)


def seq_len(a: argparse.Namespace) -> int:
    return 64 if a.tiny else 2048


def shared_overrides(a: argparse.Namespace) -> list[str]:
    """What every side shares: the LoRA, the shapes, the dtypes and the optimizer."""
    return [f"model.lora.rank={a.rank}", f"model.lora.alpha={a.alpha}", "model.lora.targets=[q,k,v,o,gate,up,down]",
            f"model.param_dtype={a.dtype}", f"model.compute_dtype={a.dtype}", f"data.seq_len={seq_len(a)}",
            f"train.batch_size={a.batch}", "train.micro_batches=1", f"optim.lr={LR}", "optim.weight_decay=0.0",
            "optim.grad_clip=1.0", "optim.schedule=constant", "optim.warmup_steps=0"]


def native_config(a: argparse.Namespace) -> Any:
    from jaxtune.config import load_config

    return load_config(None, ["model.family=gemma3", f"model.preset={'tiny' if a.tiny else 'gemma3-1b'}",
                              f"model.attention={a.attention}", *shared_overrides(a)])


def write_hf_config(a: argparse.Namespace, directory: str) -> str:
    """The preset's shapes as the config.json jaxtune's exporter writes (no cache: training)."""
    from jaxtune.models import FAMILIES, model_config

    mcfg = model_config(native_config(a).model).replace(lora=None)
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump({**FAMILIES["gemma3"].to_hf(mcfg), "use_cache": False}, f)
    return path


def batches(a: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    return g.packed_rows(0, N_BATCHES, a.batch, seq_len(a), vocab)


def count(tree: Any) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------- the jaxtune sides
def jaxtune_run(a: argparse.Namespace, cfg: Any, label: str) -> dict[str, Any]:
    """A jaxtune LoRA step (either backend) as ``train()`` builds it, timed."""
    js = h.jaxtune_step(cfg)
    vocab = js["spec"].model_cfg.vocab_size
    trainable = count(js["state"].params)  # before the first step donates the state
    return {"implementation": label, **g.time_jaxtune(js, batches(a, vocab), a.warmup, a.steps),
            "trainable_params": trainable, "vocab": vocab}


def native_side(a: argparse.Namespace) -> dict[str, Any]:
    cfg = native_config(a)
    attn = ("cuDNN fused attention (jax.nn.dot_product_attention implementation=cudnn) with the packed/window "
            "mask as a dense bias" if cfg.model.attention == "cudnn" else "XLA (jaxtune's layers.attention)")
    return {**jaxtune_run(a, cfg, LABELS[NATIVE]), "attention": attn}


def torchax_side(a: argparse.Namespace) -> dict[str, Any]:
    from jaxtune.config import load_config

    g.torch_threads(a)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, ["model.backend=torchax", f"model.hf_config={write_hf_config(a, tmp)}",
                                 *shared_overrides(a)])
        row = jaxtune_run(a, cfg, LABELS[TORCHAX])
    return {**row, "attention": "transformers sdpa -> torchax's XLA reference attention (dense mask)"}


# ---------------------------------------------------------------- transformers + PEFT
def hf_side(a: argparse.Namespace) -> dict[str, Any]:
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    device, name = g.torch_device()
    g.torch_threads(a)
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        hf_cfg = transformers.AutoConfig.from_pretrained(os.path.dirname(write_hf_config(a, tmp)))
    bf16 = a.dtype == "bfloat16"
    # Built as the torchax backend builds its module: seed 0, float32 on the CPU, wrapped by PEFT there (the same
    # random stream draws the adapters' A); then the frozen base is cast to bf16 (the adapters stay float32) and the
    # whole moved to the GPU. Both sides start from the same weights.
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    lcfg = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=HF_TARGETS, lora_dropout=0.0, bias="none",
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lcfg)
    if bf16:  # cast before moving: the float32 base never occupies the GPU
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    model.to(device)
    model.train()  # every dropout is 0
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=device == "cuda")
    vocab = hf_cfg.vocab_size

    def to_torch(b):
        labels = b["targets"].copy()
        labels[b["loss_mask"] == 0] = -100
        return {"ids": torch.from_numpy(b["inputs"]).long().to(device),
                "positions": torch.from_numpy(b["positions"]).long().to(device),
                "labels": torch.from_numpy(labels).long().to(device)}

    data = [to_torch(b) for b in batches(a, vocab)]

    def step(i: int) -> float:
        b = data[i % N_BATCHES]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=b["ids"], position_ids=b["positions"]).logits
        loss = F.cross_entropy(logits.float().view(-1, vocab), b["labels"].view(-1), ignore_index=-100)
        return g.torch_update(loss, trainable, opt, device)

    timing = g.timed(step, a.warmup, a.steps)
    return {"implementation": LABELS[HF], "device": name, **timing, "compiles_first_step": 0,
            "compiles_after_first_step": 0, **g.torch_peak_memory(device),
            "trainable_params": sum(p.numel() for p in trainable), "vocab": vocab,
            "attention": "sdpa with transformers' packed-sequence mask (from position_ids)"}


SIDES = {NATIVE: native_side, HF: hf_side, TORCHAX: torchax_side}


# ---------------------------------------------------------------- the parent
def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g.add_args(ap, warmup=3, steps=10, batch=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--attention", choices=["cudnn", "xla", "auto"], default="cudnn",
                    help="jaxtune native's model.attention")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="base weights and compute, every side")
    args = g.parse_args(ap, argv, batch=2, warmup=0, steps=2, attention="auto", dtype="float32")
    if args.side:
        g.run_child(args, SIDES)
        return {}

    base = g.missing("jax", "flax", "optax")
    sides = {NATIVE: {"skip": base, "jax": True},
             HF: {"skip": base or g.missing("torch", "transformers", "peft"), "jax": False},
             TORCHAX: {"skip": base or g.missing("torch", "transformers", "peft", "torchax"), "jax": True}}
    sides = g.select_sides(ap, args, sides)
    seq = seq_len(args)
    result: dict[str, Any] = {"benchmark": "lora_gemma3_1b", "tiny": args.tiny, "seq": seq,
                              "versions": g.versions("jax", "jaxlib", "flax", "optax", "torch", "transformers",
                                                     "peft", "torchax", "numpy"),
                              "args": {k: v for k, v in vars(args).items() if k not in ("side", "side_out")}}

    def save(rows: dict[str, Any], b: int) -> None:
        result.update(batch=b, tokens_per_step=b * seq, rows=[{"side": k, **v} for k, v in rows.items()],
                      complete=len(rows) == len(sides))
        g.dump(args.json, result)

    rows, batch = g.run_sides(os.path.abspath(__file__), argv, sides, args.batch, save)
    tokens = batch * seq
    for r in rows.values():
        if not g.status(r):
            r["tokens_per_s"] = tokens / (r["ms_per_step"] / 1e3)
    counts = {r["trainable_params"] for r in rows.values() if not g.status(r)}
    result["same_trainable_params"] = len(counts) <= 1
    if not (g.status(rows.get(HF, {"skipped": 1})) or g.status(rows.get(TORCHAX, {"skipped": 1}))):
        result["torchax_vs_hf_loss_rel"] = max(abs(x - y) / abs(y) for x, y in
                                               zip(rows[TORCHAX]["losses"], rows[HF]["losses"], strict=True))
    save(rows, batch)

    device = next((r.get("device") for r in rows.values() if r.get("device")), "?")
    trained = ", ".join(f"{LABELS[k]}: {r['trainable_params']:,}" for k, r in rows.items() if not g.status(r))
    print(f"\nGemma 3 {'tiny' if args.tiny else '1B'} shapes, LoRA r {args.rank} alpha {args.alpha:g} on q k v o gate "
          f"up down ({trained} trainable); {args.dtype}; packed rows, batch {batch} x seq {seq} = {tokens:,} "
          f"tokens/step; first step + {args.warmup} warm-up + {args.steps} timed steps per side, each side in its "
          f"own process; device: {device}")
    hf_tps = rows.get(HF, {}).get("tokens_per_s")
    head = ["implementation", "tokens/s", "ms/step (median / min)", "vs transformers+PEFT", "peak memory (GB)",
            "first step (s)", "compile (s)", "XLA compiles (first step / after)", "loss first / last"]
    g.print_rows(head, rows, LABELS, lambda r: [
        r["implementation"], g.fmt(r["tokens_per_s"]), f"{r['ms_per_step']:.1f} / {r['ms_per_step_min']:.1f}",
        g.fmt(hf_tps and r["tokens_per_s"] / hf_tps, ".2f") + ("x" if hf_tps else ""),
        f"{r['peak_mem_gb']:.2f}", f"{r['first_step_s']:.1f}", f"{r['compile_s']:.1f}",
        f"{r['compiles_first_step']} / {r['compiles_after_first_step']}",
        f"{r['loss_first']:.4f} / {r['loss_last']:.4f}"])
    if "torchax_vs_hf_loss_rel" in result:
        print(f"same weights (seed 0) and batches: jaxtune torchax vs transformers + PEFT, largest relative loss "
              f"difference over the {len(rows[HF]['losses'])} steps: {result['torchax_vs_hf_loss_rel']:.1e}")
    print("attention: " + "; ".join(f"{LABELS[k]}: {r['attention']}" for k, r in rows.items() if not g.status(r)))
    print("compile (s) = first step - median step (transformers + PEFT runs eager: its first step is CUDA/cuBLAS "
          "warm-up). peak memory: " + ", ".join(f"{LABELS[k]}: {r['peak_mem_source']}" for k, r in rows.items()
                                               if not g.status(r)))
    failed = [k for k, r in rows.items() if g.status(r) and not r.get("skipped")]
    if failed or not result["same_trainable_params"]:
        sys.exit(f"side(s) without a result: {failed}" if failed else
                 "the sides train different numbers of adapter parameters: not the same LoRA")
    return result


if __name__ == "__main__":
    main()
