"""Where a small CPU run's wall time goes besides the train steps: `jaxtune train` as a user runs it, before and
after the process-level fixes, side by side in one script.

    python benchmarks/overhead.py                 # 2,000 steps: 4 layers, d_model 128, batch 12, seq 64, eval every 250
    python benchmarks/overhead.py --tiny          # seconds: 30 steps (the test suite runs this)

Each row is one `jaxtune train` process (the console entry point, as a user starts it) on the same config, its
data already tokenized by a warm-up run (a second run of a config finds its tokens cached; tokenizing is measured by
`benchmarks/tokenizing.py`). The rows:

* ``glibc default, no cache``: ``JAXTUNE_MALLOC=default`` and ``train.compile_cache_dir=null``: as before the fixes.
* ``tuned malloc, cold cache``: the CLI's allocator setting (`jaxtune.runtime.tune_malloc`) and the persistent
  compilation cache (``train.compile_cache_dir``'s default) on an empty cache directory: a first run.
* ``tuned malloc, warm cache``: the same again: every later run (a resume, a second run with the same shapes).

Per row: process wall time (spawn to exit), the run's own phases (summary.json ``seconds``: setup, compile, steps,
eval, save, finish), the rest (interpreter start and imports: wall minus the phases), the share of wall outside the
steps, CPU user/system seconds, minor page faults and peak RSS of the process (`os.wait4`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _harness import cpu_model, print_header, run_record

CONFIG = """\
name: overhead
model: {{family: gpt2, preset: tiny, n_layer: 4, n_head: 4, d_model: 128, max_seq_len: 64, dropout: 0.0}}
data: {{sources: [python-stdlib], max_bytes: {max_bytes}, seq_len: 64, val_fraction: 0.02}}
tokenizer: {{kind: bpe, vocab_size: 4096, train_bytes: 2000000}}
optim: {{name: adamw, lr: 2.0e-3, warmup_steps: 30, schedule: cosine}}
train: {{seed: 0, steps: {steps}, batch_size: 12}}
eval: {{every: {every}, batches: 8, prompts: ["def f(n):"], max_new_tokens: 32}}
checkpoint: {{every: {ckpt}, keep: 2}}
logging: {{every: 50, progress: false, tensorboard: false}}
"""


def run(config: Path, work: Path, name: str, env: dict[str, str], extra: list[str]) -> dict:
    """One `jaxtune train` process: wall, first stderr line, its own rusage (`os.wait4`) and its summary.json."""
    run_dir = work / name.replace(" ", "-").replace(",", "")
    cmd = [sys.executable, "-m", "jaxtune.cli", "train", str(config), f"run_dir={run_dir}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    first_s = time.perf_counter() - t0
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.append(proc.stderr.read()))
    reader.start()
    proc.stdout.read()
    reader.join()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{name}: jaxtune train failed ({proc.returncode}):\n{first}{rest[0][-3000:]}")
    seconds = json.loads((run_dir / "summary.json").read_text())["seconds"]
    return {"row": name, "wall_s": wall, "first_output_s": first_s, "phases": seconds,
            "outside_steps": 1 - seconds["steps"] / wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "minor_faults": usage.ru_minflt, "peak_rss_mb": usage.ru_maxrss / 1024}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=250, help="eval.every")
    ap.add_argument("--tiny", action="store_true", help="30 steps, eval every 10, a 300 kB corpus")
    ap.add_argument("--json", help="also write the rows and run details to this path")
    args = ap.parse_args(argv)
    steps, every, max_bytes = (30, 10, 300_000) if args.tiny else (args.steps, args.every, 4_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = work / "overhead.yaml"
        config.write_text(CONFIG.format(steps=steps, every=every, ckpt=max(steps // 4, 1), max_bytes=max_bytes))
        common = [f"data.cache_dir={work / 'data'}"]
        run(config, work, "warm-up", {}, [*common, "train.steps=1", "eval.every=0", "train.compile_cache_dir=null"])
        cache = [f"train.compile_cache_dir={work / 'xla'}"]
        rows = [
            run(config, work, "glibc default, no cache", {"JAXTUNE_MALLOC": "default"},
                    [*common, "train.compile_cache_dir=null"]),
            run(config, work, "tuned malloc, cold cache", {}, [*common, *cache]),
            run(config, work, "tuned malloc, warm cache", {}, [*common, *cache]),
        ]
    head = ["run", "wall s", "steps s", "compile s", "eval s", "setup s", "save+finish s", "start+imports s",
            "outside steps", "user s", "sys s", "minor faults", "peak RSS MB", "first output s"]
    print(f"\n{cpu_model()}, {os.cpu_count()} cores; {steps} steps, eval every {every}")
    print_header(head)
    for r in rows:
        p = r["phases"]
        inside = sum(p.values())
        print(f"| {r['row']} | {r['wall_s']:.1f} | {p['steps']:.1f} | {p.get('compile', 0):.1f} | "
              f"{p.get('eval', 0):.1f} | {p['setup']:.1f} | {p.get('save', 0) + p.get('finish', 0):.1f} | "
              f"{r['wall_s'] - inside:.1f} | {100 * r['outside_steps']:.1f}% | {r['user_s']:.1f} | {r['sys_s']:.1f} | "
              f"{r['minor_faults']:,} | {r['peak_rss_mb']:.0f} | {r['first_output_s']:.2f} |")
    if args.json:
        import jax

        Path(args.json).write_text(json.dumps({"rows": rows, **run_record(jax=jax)}, indent=2))
    return rows


if __name__ == "__main__":
    main()
