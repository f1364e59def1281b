"""The LoRA SFT step at a real model's shapes, each side alone in its own process: jaxtune's step as ``jaxtune train``
runs it on a CPU beside HF+PEFT eager as its users run it.

``lora_sft_cpu.py`` times both sides interleaved in one process; at SmolLM2-135M's shapes the two runtimes slow each
other there (both keep thread pools on the same cores, and one process has one allocator setting), so its ratio
(0.78x) was not either side's speed (0.90x alone, benchmarks/RESULTS.md). Here each side runs in a fresh child
process, in turn (jaxtune, HF+PEFT, jaxtune, HF+PEFT, ... for ``--rounds``):

- jaxtune: the allocator as the ``jaxtune`` command sets it (`jaxtune.runtime.tune_malloc` before JAX starts, then
  `runtime.HeapWatch` from the first step, each step waited for), and the step exactly as ``train()`` builds it
  (``_harness.jaxtune_step``); ``--jaxtune-malloc default`` leaves glibc's defaults instead.
- HF+PEFT eager: glibc's defaults; ``--peft-malloc tuned`` gives it `tune_malloc`'s settings too.

Model, adapters, batches, optimizer and loss are ``lora_sft_cpu.py``'s (its functions): a seeded random fp32 Llama
written with ``save_pretrained``, LoRA on all 7 projections with jaxtune's initial adapters on both sides, packed
rows, AdamW. Every child times ``--steps`` steps, each blocked on; the table gives the median of steps 3 and later,
the medians over rounds, and the children's step-1 losses, which must agree. Usage (SmolLM2-135M's shapes):

    PYTHONPATH=src python benchmarks/lora_sft_alone.py --layers 30 --d-model 576 --heads 9 --kv-heads 3 \\
        --d-ff 1536 --vocab 49152 --batch 4 --seq 512 --rank 16 --alpha 32 [--rounds 2 --steps 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from _harness import add_common_args

SIDES = ("jaxtune LoRA", "HF+PEFT eager")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, batch=4, seq=512, layers=4, d_model=256, heads=4, kv_heads=2, d_ff=688, vocab=8192, rank=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rounds", type=int, default=2, help="processes per side, in turn")
    ap.add_argument("--steps", type=int, default=7, help="steps per process (>= 4; the first 2 are not counted)")
    ap.add_argument("--jaxtune-malloc", choices=["cli", "default"], default="cli")
    ap.add_argument("--peft-malloc", choices=["default", "tuned"], default="default")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.steps < 4 or a.rounds < 1:
        ap.error("use at least 4 steps and 1 round")
    return a


def _child(a: argparse.Namespace) -> None:
    """One side's steps in this process; prints one JSON line."""
    from jaxtune import runtime

    if (a.child == SIDES[0] and a.jaxtune_malloc == "cli") or (a.child == SIDES[1] and a.peft_malloc == "tuned"):
        runtime.tune_malloc()  # before JAX starts, as the CLI does
    import jax
    import numpy as np
    import torch
    from _harness import jaxtune_step, pin_threads
    from lora_sft_cpu import HF_TARGETS, make_peft_step, packed_batch, peft_model

    from jaxtune import sharding
    from jaxtune.config import load_config

    pin_threads(a.threads)
    targets = "[" + ",".join(HF_TARGETS) + "]"
    cfg = load_config(None, [f"model.from_hf={a.dir}", f"model.lora.rank={a.rank}", f"model.lora.alpha={a.alpha}",
                             f"model.lora.targets={targets}", f"data.seq_len={a.seq}", f"train.batch_size={a.batch}",
                             f"train.steps={a.steps}", f"optim.lr={a.lr}", "optim.weight_decay=0.0",
                             "optim.grad_clip=null", "optim.schedule=constant", "optim.warmup_steps=0"])
    js = jaxtune_step(cfg)
    rng = np.random.RandomState(0)
    host = [packed_batch(rng, a.batch, a.seq, a.vocab) for _ in range(a.steps)]
    if a.child == SIDES[0]:
        box = {"state": js["state"]}
        heap = runtime.HeapWatch.start("cpu")  # None unless tune_malloc tuned this process

        def step(i: int) -> float:
            with sharding.use_mesh(js["mesh"]):
                box["state"], m = js["train_step"](box["state"], sharding.global_batch(js["mesh"], host[i]),
                                                   js["frozen"])
                jax.block_until_ready(box["state"])
            if heap is not None:
                heap.after_step()
            return float(m["loss"])
    else:
        model, _ = peft_model(a.dir, "eager", a, jax.device_get(js["state"].params))
        del js
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr,
                                betas=(cfg.optim.b1, cfg.optim.b2), eps=cfg.optim.eps, weight_decay=0.0)
        torch_step = make_peft_step(model, opt, packed=True)

        def step(i: int) -> float:
            b = host[i]
            labels = np.where(b["loss_mask"] > 0, b["targets"], -100)
            return torch_step({"inputs": torch.from_numpy(b["inputs"].astype(np.int64)),
                               "positions": torch.from_numpy(b["positions"].astype(np.int64)),
                               "labels": torch.from_numpy(labels.astype(np.int64))})
    times, losses, faults = [], [], []
    for i in range(a.steps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps({"times": times, "losses": losses, "faults": faults,
                      "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}))


def _spawn(a: argparse.Namespace, argv: list[str], side: str, directory: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv, "--child", side, "--dir", directory], check=False,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    if out.returncode:
        raise RuntimeError(f"{side} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    a = _args(argv)
    if a.child:
        return _child(a)
    import jax
    import peft
    import torch
    import transformers
    from _harness import machine, print_header, run_record
    from lora_sft_cpu import RTOL, write_hf_model

    tmp = tempfile.TemporaryDirectory()
    n_params = write_hf_model(tmp.name, a)
    runs = {side: [] for side in SIDES}
    for _ in range(a.rounds):
        for side in SIDES:
            runs[side].append(_spawn(a, argv, side, tmp.name))
    tmp.cleanup()
    rows = []
    for side, rs in runs.items():
        per_run = [statistics.median(r["times"][2:]) for r in rs]
        rows.append({"implementation": side, "s_per_step": statistics.median(per_run), "per_process": per_run,
                     "faults_per_step": statistics.median(f for r in rs for f in r["faults"][2:]),
                     "maxrss_mb": max(r["maxrss_mb"] for r in rs), "loss_step1": rs[0]["losses"][0],
                     "loss_step2": rs[0]["losses"][1]})
    jx, hf = rows
    diff = abs(jx["loss_step1"] - hf["loss_step1"]) / abs(hf["loss_step1"])
    print(f"machine: {machine()}\nLlama (random, fp32) {n_params / 1e6:.1f}M params, {a.layers} layers, d {a.d_model}, "
          f"LoRA r{a.rank} on 7 projections, {a.batch} x {a.seq} packed tokens; {a.rounds} process(es) per side, "
          f"{a.steps} steps each; jaxtune malloc: {a.jaxtune_malloc}, HF+PEFT malloc: {a.peft_malloc}")
    print_header(["implementation", "s / step (median)", "per process", "minor faults / step", "peak RSS (MB)",
                  "loss step 1", "vs HF+PEFT eager"])
    for r in rows:
        print(f"| {r['implementation']} | {r['s_per_step']:.2f} | {' / '.join(f'{t:.2f}' for t in r['per_process'])} "
              f"| {r['faults_per_step']:,.0f} | {r['maxrss_mb']:,} | {r['loss_step1']:.6f} | "
              f"{hf['s_per_step'] / r['s_per_step']:.2f}x |")
    print(f"step-1 losses' relative difference {diff:.1e} (must be < {RTOL:g})")
    if diff > RTOL:
        raise SystemExit("the two sides' step-1 losses disagree: not the same computation")
    result = run_record(jax=jax, torch=torch, transformers=transformers, peft=peft) | {
        "config": vars(a) | {"params": n_params}, "rows": rows,
        "ratio_jaxtune_vs_hf_eager": hf["s_per_step"] / jx["s_per_step"]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
