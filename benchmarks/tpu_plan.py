"""Recipes x Cloud TPU slices, planned from this CPU machine: `jaxtune info --compile-for` for each pair (the real
train step compiled by libtpu for the slice), as the "Planning a TPU run" table of docs/scale-out.md.

    python benchmarks/tpu_plan.py [--recipes gpt2-124m ...] [--slices v5e-8 ...] [--search-seconds 600] [--json PATH]
    python benchmarks/tpu_plan.py --post-training --recipes gemma3-1b-grpo --slices v5e-8 --write

``--write`` rewrites each planned pair's row in the post-training tables of README.md and docs/scale-out.md (the
rows that start with the recipe and the slice) from the fresh plan: what tests/test_aot.py's doc check compares.

A recipe's batch is kept where the slice can split it; otherwise it is the smallest multiple of the data-parallel
degree at or above it, with train.micro_batches lowered until each micro-batch still splits (the table says so).
"Suggested batch" is the largest global batch the compiler accepted (doubling, then bisection, within
``--search-seconds`` of compiling per pair), with the smallest it refused, or "+" when none was refused yet.
Needs ``pip install 'jaxtune[aot]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import _harness as h
import jax

from jaxtune import aot, runtime
from jaxtune.config import load_config

RECIPES = ("gpt2-124m", "gemma3-1b-lora-dolly", "llama3-8b-fsdp")
SLICES = ("v5e-8", "v5p-64", "v6e-256")
# Post-training (--post-training): DPO's train step (pairs: 2 sequences an item), and GRPO's sampler beside its step.
POST_RECIPES = ("qwen-dpo-ultrafeedback", "gemma3-1b-grpo")
POST_SLICES = ("v5e-8", "v6e-8")


def fitted(recipe: str, slice_name: str) -> tuple[list[str], str]:
    """Overrides that make ``recipe``'s batch split over ``slice_name``'s data-parallel devices, and what changed."""
    cfg = load_config(recipe)
    chips = aot.tpu_slice(slice_name).chips
    m = cfg.mesh
    fixed = math.prod(s for s in (m.data, m.fsdp, m.tensor) if s != -1)
    dp = chips // m.tensor if -1 in (m.data, m.fsdp) else m.data * m.fsdp
    assert chips % fixed == 0, (recipe, slice_name)
    batch = -(-cfg.train.batch_size // dp) * dp
    micro = max(k for k in range(1, cfg.train.micro_batches + 1)
                if cfg.train.micro_batches % k == 0 and batch % (dp * k) == 0)
    changes = []
    if batch != cfg.train.batch_size:
        changes.append(f"batch {cfg.train.batch_size} -> {batch}")
    if micro != cfg.train.micro_batches:
        changes.append(f"micro-batches {cfg.train.micro_batches} -> {micro}")
    return [f"train.batch_size={batch}", f"train.micro_batches={micro}"], ", ".join(changes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+")
    ap.add_argument("--slices", nargs="+")
    ap.add_argument("--search-seconds", type=float, default=600.0, help="largest-batch search budget per pair "
                    "(0: no search)")
    ap.add_argument("--json", help="also write the rows and run details to this path")
    ap.add_argument("--post-training", action="store_true", help=f"the post-training table: {', '.join(POST_RECIPES)} "
                    f"on {', '.join(POST_SLICES)} (no batch search), GRPO's step split into generation and training")
    ap.add_argument("--write", action="store_true", help="rewrite the planned rows of the post-training tables in "
                    "README.md and docs/scale-out.md")
    args = ap.parse_args()
    if args.post_training:
        args.search_seconds = 0.0
    args.recipes = args.recipes or list(POST_RECIPES if args.post_training else RECIPES)
    args.slices = args.slices or list(POST_SLICES if args.post_training else SLICES)
    runtime.quiet_libtpu()
    import libtpu

    rows = []
    head = ["recipe", "slice", "batch x seq", "fits", "memory / chip", "step (roofline)", "bound", "MFU",
            "tokens/s", "suggested batch", "compile"]
    if args.post_training:
        head = [*head[:-2], "sampler / chip", "GRPO step: generation + training", "compile"]
    h.print_header(head, text_columns=2)
    for recipe in args.recipes:
        for slice_name in args.slices:
            overrides, changed = fitted(recipe, slice_name)
            started = time.perf_counter()
            d = aot.plan(load_config(recipe, overrides), slice_name, args.search_seconds)
            d.update(recipe=recipe, adjusted=changed, seconds=time.perf_counter() - started)
            rows.append(d)
            print(row(d, args.post_training), flush=True)
            if args.write:
                write_rows(d)
    print(f"\nmachine: {h.machine()}; jax {jax.__version__}, libtpu {libtpu.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, **h.run_record(jax=jax, libtpu=libtpu), "machine_text": h.machine()}, f,
                      indent=1, default=str)


def row(d: dict, post_training: bool = False) -> str:
    m, s = d["memory"], d["slice"]
    usable = s["hbm_usable"] / aot.GiB
    total = m["total"] / aot.GiB if m["total"] is not None else None
    memory = f"{total:.1f} / {usable:.2f} GiB" if d["fits"] else (
        f">= {total:.1f} / {usable:.2f} GiB" if total is not None else "refused")
    n = d.get("sequences", 1)
    batch = (f"{d['batch_size']} {d['unit']} x {n} x {d['seq_len']}" if n > 1
             else f"{d['batch_size']} x {d['seq_len']}") \
        + (f" ({d['adjusted']})" if d["adjusted"] else "")
    rl = d.get("roofline")
    lb = d.get("largest_batch")
    suggested = "-" if lb is None else str(lb["batch_size"] or "none") + (
        f" ({lb['refused']} refused)" if lb["refused"] else "+")
    cells = [d["recipe"], s["name"], batch, "fits" if d["fits"] else "**does not fit**", memory,
             f"{1e3 * rl['step_seconds']:.0f} ms" if rl else "-", rl["bound"] if rl else "-",
             f"{100 * rl['mfu']:.0f}%" if rl else "-", f"{rl['tokens_per_second']:,.0f}" if rl else "-", suggested,
             f"{d['seconds']:.0f} s"]
    if post_training:
        sp, e = d.get("sampler"), d.get("estimate")
        sampler = "-" if not sp or "skipped" in sp else (
            f"{sp['total'] / aot.GiB:.1f} GiB ({'fits' if sp['fits'] else 'does not fit'}; KV cache "
            f"{sp['kv_cache'] / aot.GiB:.2f})")
        split = "-" if not e or "step" not in e else (
            f"{e['step']:.1f} s = {e['generation']:.1f} + {max(e['training_roofline'], e['training_at_mfu']):.1f}")
        cells = [*cells[:-2], sampler, split, cells[-1]]
    return "| " + " | ".join(cells) + " |"


ROOT = Path(__file__).resolve().parent.parent
DOCS = {"README.md": "readme", "docs/scale-out.md": "scale_out"}


def step_split(d: dict) -> str:
    """GRPO's step estimate as the tables print it: "1.1 s = 0.7 + 0.4" (generation + training), or "-"."""
    e = d.get("estimate")
    if not e or "step" not in e:
        return "-"
    return f"{e['step']:.1f} s = {e['generation']:.1f} + {max(e['training_roofline'], e['training_at_mfu']):.1f}"


def doc_cells(d: dict, doc: str) -> list[str]:
    """The cells after the recipe's name of its post-training row in README.md (``readme``) or docs/scale-out.md
    (``scale_out``), from a plan (`aot.plan` with ``recipe`` and ``seconds`` added)."""
    s, m, rl, sp = d["slice"], d["memory"], d["roofline"], d.get("sampler")
    memory = f"{m['total'] / aot.GiB:.1f} / {s['hbm_usable'] / aot.GiB:.2f} GiB"
    sampler = "-" if not sp or "skipped" in sp else f"{sp['total'] / aot.GiB:.1f} GiB"
    step = f"{1e3 * rl['step_seconds']:.0f} ms"
    if doc == "readme":
        return [s["name"], memory, step, sampler, step_split(d)]
    if sampler != "-":
        sampler += f" ({'fits' if sp['fits'] else 'does not fit'}; KV cache {sp['kv_cache'] / aot.GiB:.2f})"
    batch = f"{d['batch_size']} {d['unit']} x {d.get('sequences', 1)} x {d['seq_len']}"
    return [s["name"], batch, "fits" if d["fits"] else "**does not fit**", memory, step, rl["bound"],
            f"{100 * rl['mfu']:.0f}%", f"{rl['tokens_per_second']:,.0f}", sampler, step_split(d),
            f"{d['seconds']:.0f} s"]


def doc_row(text: str, recipe: str, slice_name: str) -> tuple[int, list[str]] | None:
    """The line index and cells of the table row for ``recipe`` on ``slice_name`` in a doc's text (the README names
    a recipe's first row with a description in parentheses), or None."""
    for i, line in enumerate(text.splitlines()):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) > 2 and re.sub(r" \(.*\)$", "", cells[0]) == recipe and cells[1] == slice_name:
            return i, cells
    return None


def write_rows(d: dict) -> None:
    """Rewrite ``d``'s row in each doc's post-training table, keeping the row's first cell (its description)."""
    for rel, doc in DOCS.items():
        path = ROOT / rel
        lines = path.read_text().splitlines(keepends=True)
        found = doc_row("".join(lines), d["recipe"], d["slice"]["name"])
        if found is None:
            continue
        i, cells = found
        lines[i] = "| " + " | ".join([cells[0], *doc_cells(d, doc)]) + " |\n"
        path.write_text("".join(lines))


if __name__ == "__main__":
    main()
