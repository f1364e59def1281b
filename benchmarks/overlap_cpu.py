"""Overlapped RL on CPU (``objective.max_staleness``, ``mesh.rollout``): the GRPO quickstart's real job, on-policy
beside sampled ahead, wall time per step and held-out accuracy after the same steps.

The job is the grpo-quickstart recipe's chain as its header writes it (the careless-tutor SFT, exported, then GRPO on
the sums; `benchmarks/quickstart_check.py` runs the same chain), its SFT done once in ``--work``. Each variant is the
GRPO run of ``--steps`` steps as a fresh process (``jaxtune train grpo-quickstart ...``) on 1 or 2 simulated CPU
devices (``--xla_force_host_platform_device_count``; the cores are the machine's either way):

- ``on-policy``: max_staleness 0 (today's loop), 1 device;
- ``ahead``: max_staleness 1 on the same device (the sampler's programs queued beside the step, the host's rewards and
  layout overlapping it);
- ``on-policy, 2 devices``: max_staleness 0, the batch split over 2 devices (mesh data=2);
- ``ahead, own device``: max_staleness 1, mesh.rollout=1 (the learner on one device, the sampler on the other).

Per variant: the train loop's seconds per step (summary.json's ``steps`` lap over the steps after the first, which
compiles; evaluations are their own lap), the rollout's generation seconds per step (``time/generation``), and the
held-out accuracy (100 sums, greedy) at the last step. Run:

    python benchmarks/overlap_cpu.py --work /tmp/overlap --steps 60 --json overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import machine, save_json
from quickstart_check import header_commands, made, seeded

# A reward that waits JUDGE_SECONDS a batch and scores 0 (weight 0: the learning is the recipe's): a stand-in for the
# round trip to an external judge or sandbox (an API, a code runner in another process), which uses no core here.
JUDGE = """
import os, time
def judged(prompts, completions, rows):
    time.sleep(float(os.environ["JUDGE_SECONDS"]))
    return [0.0] * len(completions)
"""
REWARDS = ("objective.rewards=[{name: exact_number, field: answer, weight: 1.0}, {name: format, pattern: "
           "'\\d\\+\\d=\\d+, \\d\\+\\d(\\+1)?=\\d+, so \\d+\\.', weight: 0.2}, "
           "{name: 'judge:judged', weight: 0.0}]")
VARIANTS = {
    "on-policy": (1, []),
    "ahead": (1, ["objective.max_staleness=1"]),
    "on-policy, 2 devices": (2, ["mesh.data=2"]),
    "ahead, own device": (2, ["objective.max_staleness=1", "mesh.rollout=1"]),
    "on-policy, judged": (1, [REWARDS]),
    "ahead, judged": (1, ["objective.max_staleness=1", REWARDS]),
}


def run_variant(work: Path, name: str, devices: int, extra: list[str], steps: int, seed: int, judge: float) -> dict:
    run_dir = work / ("grpo-" + name.replace(", ", "-").replace(" ", "-"))
    shutil.rmtree(run_dir, ignore_errors=True)  # each round a fresh run
    cmd = [sys.executable, "-m", "jaxtune.cli", "train", "grpo-quickstart", f"run_dir={run_dir}",
           f"train.steps={steps}", f"eval.every={steps}", f"checkpoint.every={steps}", "logging.every=1",
           "logging.progress=false", f"train.seed={seed}", *extra]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               JUDGE_SECONDS=str(judge), PYTHONPATH=str(work))
    subprocess.run(cmd, cwd=work, check=True, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval" and "accuracy" in r]
    return {"variant": name, "devices": devices, "overrides": extra,
            "seconds_per_step": summary["seconds"]["steps"] / (steps - 1),
            "generation_seconds": statistics.median(r["time/generation"] for r in train[1:]),
            "accuracy_start": evals[0]["accuracy"], "accuracy_end": evals[-1]["accuracy"],
            "staleness": statistics.mean(r.get("staleness", 0.0) for r in train)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the SFT and the runs go (the SFT is reused)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--judge-seconds", type=float, default=0.1, help="the judged variants' wait per batch")
    ap.add_argument("--rounds", type=int, default=1, help="each variant this many times, interleaved (medians)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    *before, last = header_commands("grpo-quickstart")
    assert last[2] == "grpo-quickstart", last
    for cmd in before:  # the SFT and its export, once
        if not made(cmd, args.work):
            subprocess.run(seeded(cmd, args.seed), cwd=args.work, check=True)
    (args.work / "judge.py").write_text(JUDGE)
    runs = [[run_variant(args.work, v, *VARIANTS[v], args.steps, args.seed, args.judge_seconds)
             for v in args.variants] for _ in range(args.rounds)]
    rows = [{**got[-1], "seconds_per_step": statistics.median(r["seconds_per_step"] for r in got),
             "rounds": [r["seconds_per_step"] for r in got]} for got in zip(*runs)]
    base = {}
    print(f"\n{machine()}\ngrpo-quickstart, {args.steps} steps, seed {args.seed}, {args.rounds} rounds "
          "(median s/step)\n")
    print("| variant | devices | s/step | vs on-policy (same devices, rewards) | generation s/step "
          "| held-out accuracy |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        ref = base.setdefault((r["devices"], "judged" in r["variant"]), r["seconds_per_step"])
        print(f"| {r['variant']} | {r['devices']} | {r['seconds_per_step']:.2f} | {ref / r['seconds_per_step']:.2f}x "
              f"| {r['generation_seconds']:.2f} | {r['accuracy_start']:.0%} -> {r['accuracy_end']:.0%} |")
    save_json(args.json, {"machine": machine(), "steps": args.steps, "seed": args.seed, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
