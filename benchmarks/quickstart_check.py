"""Run a post-training quickstart as its config's header says, from an empty directory, offline, and fail unless its
held-out metric moves the right way: the check that the numbers a recipe promises are what its commands give.

The commands are read from the recipe's own header (the ``#   jaxtune ...`` lines, a trailing ``\\`` continuing a
line), so the header cannot drift from what is checked. Each runs as a subprocess of this Python (``python -m
jaxtune.cli``); the last one trains the recipe, whose run directory's metrics.jsonl holds the held-out evaluations.

    python benchmarks/quickstart_check.py gkd-quickstart     # held-out accuracy must rise by >= 20 points
    python benchmarks/quickstart_check.py kto-quickstart     # the held-out reward margin must rise above 0.1

Exit status 0 when the metric moved as required, 1 when it did not, 2 when a command failed. CPU minutes: gkd ~3,
kto ~2 (2 cores).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxtune.config.load import resolve_config_path

# recipe -> (eval metric, what it must do, first -> last -> ok)
CHECKS = {
    "gkd-quickstart": ("accuracy", "rise by at least 0.20", lambda a, b: b - a >= 0.20),
    "kto-quickstart": ("rewards/margins", "rise from 0 to above 0.10", lambda a, b: b > 0.10 and b > a),
}


def header_commands(recipe: str) -> list[list[str]]:
    """The ``jaxtune`` commands of the recipe's header comment, in order, as argument lists."""
    lines, commands, pending = resolve_config_path(recipe).read_text().splitlines(), [], ""
    for line in lines:
        if not line.startswith("#"):
            break
        text = line[1:].split("  #")[0].strip() if not pending else line[1:].strip().split("  #")[0].strip()
        if not pending and not text.startswith("jaxtune "):
            continue
        pending += (" " if pending else "") + text.rstrip("\\").strip()
        if not text.endswith("\\"):
            commands.append(shlex.split(pending))
            pending = ""
    return commands


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipe", choices=sorted(CHECKS))
    ap.add_argument("--keep", help="run in this directory (kept) instead of a temporary one")
    args = ap.parse_args(argv)
    metric, wanted, ok = CHECKS[args.recipe]
    commands = header_commands(args.recipe)
    if not commands or commands[-1][:3] != ["jaxtune", "train", args.recipe]:
        print(f"error: {args.recipe}'s header does not end with `jaxtune train {args.recipe}`: {commands}")
        return 2
    work = Path(args.keep or tempfile.mkdtemp(prefix=f"{args.recipe}-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for cmd in commands:
        print("$ " + shlex.join(cmd), flush=True)
        done = subprocess.run([sys.executable, "-m", "jaxtune.cli", *cmd[1:], "logging.progress=false"]
                              if cmd[1] == "train" else [sys.executable, "-m", "jaxtune.cli", *cmd[1:]], cwd=work,
                              check=False)
        if done.returncode:
            print(f"error: `{shlex.join(cmd)}` exited with {done.returncode}")
            return 2
    run_dir = work / "runs" / args.recipe
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "eval" and metric in r]
    first, last = evals[0][metric], evals[-1][metric]
    moved = ok(first, last)
    print(f"{args.recipe}: held-out {metric} {first:.3f} at step {evals[0]['step']} -> {last:.3f} at step "
          f"{evals[-1]['step']} (must {wanted}): {'ok' if moved else 'FAILED'}; {time.perf_counter() - started:.0f} s "
          f"in {work}")
    return 0 if moved else 1


if __name__ == "__main__":
    sys.exit(main())
