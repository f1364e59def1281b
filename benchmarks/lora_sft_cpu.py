"""CPU LoRA supervised fine-tuning throughput: jaxtune's real LoRA train step vs transformers + PEFT.

One random Llama-architecture transformers model (fp32, seeded) is written with ``save_pretrained`` into a temp
dir, and both sides start from it:

- jaxtune: a config with ``model.from_hf=<dir>``, ``model.lora.rank/alpha/targets`` and AdamW, built exactly as
  ``train()`` builds it: ``make_state_spec`` → ``NativeSpec.init`` (the adapters) and ``load_frozen`` (the base
  read from the checkpoint, outside the train state) → ``jit_steps`` (``jax.jit`` with explicit
  in/out shardings, the state donated, the frozen base passed as a third argument; under ``use_mesh``.
- transformers + PEFT: ``LlamaForCausalLM.from_pretrained(<dir>, attn_implementation="eager" | "sdpa")`` wrapped
  by ``get_peft_model(LoraConfig(r, lora_alpha, target_modules=q_proj ... down_proj, lora_dropout=0))``,
  ``torch.optim.AdamW`` over the trainable (adapter) parameters. Its ``lora_A`` matrices are set to jaxtune's
  initial ``lora_a`` (through jaxtune's own PEFT export, ``jaxtune.models.lora.peft_tensors``); ``lora_B`` is zero
  on both sides, so the step-1 losses must agree.

Optimizer on both sides: AdamW with the same lr, betas and eps, weight decay 0, constant lr, no gradient
clipping. Data: packed SFT batches (B, T) like ``jaxtune.data.sft`` makes them: every row holds 3-4 segments
(examples), positions restart at 0 in each, a loss mask counts the second part ("completion") of every
segment, about half the tokens; rows are full (no padding). jaxtune gets ``inputs``, ``targets``,
``positions``, ``segment_ids`` and ``loss_mask``. transformers gets ``input_ids`` and ``position_ids`` with
``attention_mask=None``: transformers' mask builder (5.23 here: ``masking_utils.find_packed_sequence_indices``)
detects the position restarts and builds the block-diagonal causal mask for eager and sdpa alike, so both
sides do the same (packed) attention; the loss is mean cross-entropy over the counted tokens (labels -100
elsewhere). ``--hf-unpacked`` instead gives transformers plain causal rows (no position restarts: less masking
work, a different function).

Timing as in ``cpu_step.py``: after the first (compiling) step and warm-up rounds, the implementations are
interleaved round by round in one process (order rotated every round), each round running ``--steps`` steps of
each, every step blocked on its result; the table reports medians per step. Usage:

    PYTHONPATH=src python benchmarks/lora_sft_cpu.py [--rounds 8 --steps 2 --batch 4 --seq 512 --threads N]
                                                     [--no-sdpa] [--hf-unpacked] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import warnings

import flax
import jax
import jaxlib
import numpy as np
import optax
import peft
import torch
import torch.nn.functional as F
import transformers
from _harness import (
    add_common_args,
    add_round_args,
    check_rounds,
    first_call,
    interleave,
    jaxtune_step,
    pin_threads,
    print_header,
    run_record,
    timing_row,
)

from jaxtune import sharding
from jaxtune.config import load_config
from jaxtune.models.lora import peft_tensors
from jaxtune.models.registry import FAMILIES

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RTOL = 1e-4  # same weights, adapters and batch: step-1 losses agree to float32 reduction-order noise


# ---------------------------------------------------------------- model and data
def write_hf_model(directory: str, a: argparse.Namespace) -> int:
    """A seeded random fp32 LlamaForCausalLM of the benchmark shape, saved as safetensors; returns its params."""
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   head_dim=a.d_model // a.heads, intermediate_size=a.d_ff,
                                   max_position_embeddings=max(a.seq, 512), attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def packed_batch(rng: np.random.RandomState, batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """(B, T) packed SFT rows: 3-4 segments per row filling it, positions restarting per segment, loss on the
    second part of every segment (its "completion", 30-70% of it). Ids from 1 (0 is often a pad id)."""
    out = {k: np.zeros((batch, seq), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    out["loss_mask"] = np.zeros((batch, seq), np.float32)
    for r in range(batch):
        n_seg = rng.randint(3, 5)
        cuts = np.sort(rng.choice(np.arange(32, seq - 31), n_seg - 1, replace=False))
        bounds = [0, *cuts.tolist(), seq]
        for s in range(n_seg):
            lo, hi = bounds[s], bounds[s + 1]
            toks = rng.randint(1, vocab, hi - lo + 1)  # one example: hi - lo + 1 tokens fill hi - lo positions
            out["inputs"][r, lo:hi], out["targets"][r, lo:hi] = toks[:-1], toks[1:]
            out["positions"][r, lo:hi] = np.arange(hi - lo)
            out["segment_ids"][r, lo:hi] = s + 1
            prompt = int((hi - lo) * rng.uniform(0.3, 0.7))
            out["loss_mask"][r, lo + prompt:hi] = 1.0
    return out


# ---------------------------------------------------------------- the two steps
def make_peft_step(model: torch.nn.Module, opt: torch.optim.Optimizer, packed: bool):
    def step(b: dict[str, torch.Tensor]) -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=b["inputs"], position_ids=b["positions"] if packed else None).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        return loss.item()  # blocks

    return step


def peft_model(directory: str, attn: str, a: argparse.Namespace, adapters) -> tuple[torch.nn.Module, int]:
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn,
                                                             dtype=torch.float32)
    lcfg = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=HF_TARGETS, lora_dropout=0.0, bias="none",
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lcfg)
    # jaxtune's initial adapters (A random, B zero), named as PEFT names them by jaxtune's own exporter.
    tensors = {k: torch.from_numpy(v) for k, v in
               peft_tensors(FAMILIES["llama"], jax.tree.map(jax.numpy.asarray, adapters)).items()}
    res = peft.set_peft_model_state_dict(model, tensors)
    if res.unexpected_keys:
        raise RuntimeError(f"PEFT did not take jaxtune's adapter tensors {res.unexpected_keys[:4]}")
    n_lora = sum(1 for k in model.state_dict() if ".lora_" in k)
    if n_lora != len(tensors):
        raise RuntimeError(f"PEFT model has {n_lora} adapter tensors, jaxtune exported {len(tensors)}")
    model.train()  # every dropout is 0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, trainable


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_round_args(ap, rounds=8)
    add_common_args(ap, batch=4, seq=512, layers=4, d_model=256, heads=4, kv_heads=2, d_ff=688, vocab=8192)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-sdpa", action="store_true", help="skip the transformers sdpa row")
    ap.add_argument("--scan", action="store_true", help="also jaxtune's step with model.scan_layers=true (its own "
                    "adapters, drawn per layer from split keys: the same step-1 loss, later ones close)")
    ap.add_argument("--hf-unpacked", action="store_true",
                    help="give transformers plain causal rows (no position_ids): less masking work, and a different "
                         "function, so the step-1 loss check is reported but not enforced")
    args = ap.parse_args(argv)
    check_rounds(ap, args)
    threads = pin_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)  # peft

    n_steps = 1 + (args.warmup + args.rounds) * args.steps  # per implementation, the compiling step included
    rng = np.random.RandomState(0)
    host_batches = [packed_batch(rng, args.batch, args.seq, args.vocab) for _ in range(n_steps)]
    counted = float(np.mean([b["loss_mask"].mean() for b in host_batches]))
    segs = float(np.mean([[len(np.unique(r)) for r in b["segment_ids"]] for b in host_batches]))

    tmp = tempfile.TemporaryDirectory()
    n_params = write_hf_model(tmp.name, args)
    targets = "[" + ",".join(HF_TARGETS) + "]"
    overrides = [f"model.from_hf={tmp.name}", f"model.lora.rank={args.rank}", f"model.lora.alpha={args.alpha}",
                 f"model.lora.targets={targets}", f"data.seq_len={args.seq}", f"train.batch_size={args.batch}",
                 f"train.steps={n_steps}", f"optim.lr={args.lr}", "optim.weight_decay=0.0", "optim.grad_clip=null",
                 "optim.schedule=constant", "optim.warmup_steps=0"]
    cfg = load_config(None, overrides)
    ocfg = cfg.optim

    # ---- jaxtune: the LoRA step as train() builds and jits it
    js = jaxtune_step(cfg)
    mesh, state, frozen, train_step, setup_s = (js[k] for k in ("mesh", "state", "frozen", "train_step", "setup_s"))
    init_adapters = jax.device_get(state.params)  # before the first step donates the state
    n_adapter = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(init_adapters))
    jax_batches = [sharding.global_batch(mesh, b) for b in host_batches]

    # ---- transformers + PEFT: same checkpoint, same initial adapters, same batches
    def torch_batch(b):
        labels = np.where(b["loss_mask"] > 0, b["targets"], -100)
        return {"inputs": torch.from_numpy(b["inputs"].astype(np.int64)),
                "positions": torch.from_numpy(b["positions"].astype(np.int64)),
                "labels": torch.from_numpy(labels.astype(np.int64))}

    torch_batches = [torch_batch(b) for b in host_batches]
    attns = ["eager"] + ([] if args.no_sdpa else ["sdpa"])

    impls: dict[str, dict] = {}
    with sharding.use_mesh(mesh):
        steps = {"jaxtune LoRA (jax.jit)": (state, frozen, train_step)}
        if args.scan:
            scanned = jaxtune_step(load_config(None, [*overrides, "model.scan_layers=true"]))
            steps["jaxtune LoRA, scan_layers"] = (scanned["state"], scanned["frozen"], scanned["train_step"])
        for name, (st, fr, fn) in steps.items():
            box = {"state": st, "i": 0}

            def jax_step(box=box, fr=fr, fn=fn):
                box["state"], metrics = fn(box["state"], jax_batches[box["i"]], fr)
                jax.block_until_ready((box["state"], metrics))
                box["i"] += 1
                return float(metrics["loss"])

            impls[name] = {"step": jax_step}
        trainable = {}
        for attn in attns:
            model, trainable[attn] = peft_model(tmp.name, attn, args, init_adapters)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ocfg.lr,
                                    betas=(ocfg.b1, ocfg.b2), eps=ocfg.eps, weight_decay=0.0)
            tstep, counter = make_peft_step(model, opt, packed=not args.hf_unpacked), {"i": 0}

            def hf_step(s=tstep, c=counter):
                loss = s(torch_batches[c["i"]])
                c["i"] += 1
                return loss

            impls[f"HF+PEFT {attn}"] = {"step": hf_step}

        for im in impls.values():
            im["fn"] = lambda _, st=im["step"]: [st() for _ in range(args.steps)]
            im["first_loss"], im["first_step_s"] = first_call(im["step"])  # jaxtune: trace + XLA compile + run
        run = interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
        timed_s, load0, load1 = run["seconds"], run["load_before"], run["load_after"]
    tmp.cleanup()

    # ---- report (times are per round of --steps steps: per step below)
    tokens = args.batch * args.seq
    rows = []
    ref = impls["HF+PEFT eager"]
    for name, im in impls.items():
        im["times"] = [t / args.steps for t in im["times"]]
        im["cpu"] = [c / args.steps for c in im["cpu"]]
        losses = [im["first_loss"]] + [x for out in im["outputs"] for x in out]
        im["losses"] = losses
        rows.append({"implementation": name, **timing_row(im, tokens), "first_step_s": im["first_step_s"],
                     "loss_step1": losses[0], "loss_step2": losses[1], "loss_last": losses[-1]})
    ref_losses = [ref["first_loss"]] + [x for out in ref["outputs"] for x in out]
    by = {r["implementation"]: r for r in rows}
    for r in rows:
        r["loss_step1_rel_diff_vs_eager"] = abs(r["loss_step1"] - ref_losses[0]) / abs(ref_losses[0])
        r["loss_step2_rel_diff_vs_eager"] = abs(r["loss_step2"] - ref_losses[1]) / abs(ref_losses[1])
        r["loss_last_rel_diff_vs_eager"] = abs(r["loss_last"] - ref_losses[-1]) / abs(ref_losses[-1])
    j = by["jaxtune LoRA (jax.jit)"]

    print(f"Llama (random, fp32): {args.layers} layers, hidden {args.d_model}, {args.heads} heads ({args.kv_heads} "
          f"kv), intermediate {args.d_ff}, vocab {args.vocab}, {n_params / 1e6:.2f}M params; LoRA r={args.rank} "
          f"alpha={args.alpha:g} on q k v o gate up down: {n_adapter:,} trainable (PEFT "
          + ", ".join(f"{a} {trainable[a]:,}" for a in attns) + ")")
    print(f"data: packed rows, batch {args.batch} x seq {args.seq} = {tokens} tokens/step, {segs:.1f} segments per "
          f"row, {counted:.0%} of tokens counted in the loss; AdamW lr {ocfg.lr:g} betas ({ocfg.b1}, {ocfg.b2}) "
          f"wd 0, constant lr, no clipping")
    print("attention: jaxtune segment_ids+positions (explicit block-diagonal causal mask); transformers "
          + ("plain causal rows (--hf-unpacked: position_ids not given, LESS masking work, a different function)"
             if args.hf_unpacked else "position_ids restarting per segment with attention_mask=None (transformers "
             "detects the packing and builds the same block-diagonal causal mask)"))
    print(f"threads: XLA {threads} / torch {torch.get_num_threads()}; first step + {args.warmup} warm-up round(s) + "
          f"{args.rounds} timed rounds of {args.steps} step(s) per implementation, interleaved ({timed_s:.0f} s); "
          f"load average {load0[0]:.1f} -> {load1[0]:.1f}")
    print(f"jaxtune setup (state spec, adapters init, frozen base read from the checkpoint): {setup_s:.1f} s; "
          f"time to first step (trace + compile + run): {j['first_step_s']:.1f} s")
    print("correctness (same base weights, same initial adapters, same batches; relative to HF+PEFT eager):")
    for r in rows:
        print(f"  {r['implementation']:<24} step-1 loss {r['loss_step1']:.7f} (rel diff "
              f"{r['loss_step1_rel_diff_vs_eager']:.1e})   step-2 {r['loss_step2']:.7f} (rel diff "
              f"{r['loss_step2_rel_diff_vs_eager']:.1e})   last (step {len(ref_losses)}) {r['loss_last']:.5f} "
              f"(rel diff {r['loss_last_rel_diff_vs_eager']:.1e})")
    print(f"  ln(vocab) = {math.log(args.vocab):.4f}")

    sd = not args.no_sdpa
    head = ["implementation", "tokens/s (median)", "ms/step (median / min)", "vs HF eager", "(best step)"]
    head += ["vs HF sdpa"] if sd else []
    head += ["CPU ms/step", "first step (s)", "loss step 1", "loss last"]
    print_header(head)
    e = by["HF+PEFT eager"]
    for r in rows:
        cells = [r["implementation"], f"{r['tokens_per_s']:,.0f}",
                 f"{r['ms_per_step']:.0f} / {r['ms_per_step_min']:.0f}",
                 f"{r['tokens_per_s'] / e['tokens_per_s']:.2f}x", f"{e['ms_per_step_min'] / r['ms_per_step_min']:.2f}x"]
        if sd:
            cells.append(f"{r['tokens_per_s'] / by['HF+PEFT sdpa']['tokens_per_s']:.2f}x")
        cells += [f"{r['cpu_ms_per_step']:.0f}", f"{r['first_step_s']:.1f}", f"{r['loss_step1']:.5f}",
                  f"{r['loss_last']:.5f}"]
        print("| " + " | ".join(cells) + " |")
    ratios = {"jaxtune_vs_hf_eager": j["tokens_per_s"] / e["tokens_per_s"]}
    if sd:
        ratios["jaxtune_vs_hf_sdpa"] = j["tokens_per_s"] / by["HF+PEFT sdpa"]["tokens_per_s"]
    print("\n" + ", ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()))

    result = run_record(jax=jax, jaxlib=jaxlib, flax=flax, optax=optax, torch=torch, transformers=transformers,
                        peft=peft, numpy=np) | {
        "config": vars(args) | {"threads": threads, "tokens_per_step": tokens, "params": n_params,
                                "adapter_params": n_adapter, "peft_trainable": trainable,
                                "counted_fraction": counted, "segments_per_row": segs,
                                "loadavg_before_after": [load0, load1], "timed_s": timed_s},
        "jaxtune_setup_s": setup_s, "ratios": ratios, "rows": rows,
        "losses": {name: im["losses"] for name, im in impls.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    bad = [r["implementation"] for r in rows if r["loss_step1_rel_diff_vs_eager"] > RTOL]
    if bad and not args.hf_unpacked:  # the timings would compare different computations: fail loudly
        sys.exit(f"step-1 loss differs from HF+PEFT eager by more than {RTOL:g} (relative) for {bad}")
    return result


if __name__ == "__main__":
    main()
