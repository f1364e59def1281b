"""What the GPU benchmarks share: one child process per implementation, every side timed the same way, compile
counts, peak memory and the table.

Each implementation runs in a child process of its own (``--side NAME``), one after the other: each framework gets
the whole GPU (JAX preallocates most of it; PyTorch's caching allocator keeps what it took), its own peak-memory
figure, and an out-of-memory in one cannot leave the other short. A child writes its row as JSON (``--side-out``);
the parent collects the rows, halves the batch and runs every side again when one ran out of memory (so all rows
share one batch), and prints the table.

Timing, on every side: the first step (trace + compile + run), ``--warmup`` untimed steps, then ``--steps`` steps,
each ended by a device synchronisation (the loss read back after `jax.block_until_ready` on the new state, or after
``torch.cuda.synchronize()``); the row gives the median and the fastest.

Scripts run as ``python benchmarks/gpu/NAME.py``, so this module imports as ``_gpu``; each script first puts
benchmarks/ on ``sys.path`` for ``_harness``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import _harness as h

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch: one event per XLA compile
JAXPR_TRACE = "/jax/core/compile/jaxpr_trace_duration"


def add_args(ap: Any, *, warmup: int, steps: int, batch: int) -> None:
    """The flags every GPU benchmark shares (the script adds its shapes)."""
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes, float32, 3 steps, on whatever device there is (CPU in the test suite)")
    ap.add_argument("--batch", type=int, default=batch, help="sequences per step, the same on every side (halved "
                    "for all sides when one runs out of memory)")
    ap.add_argument("--warmup", type=int, default=warmup, help="untimed steps after the first (compiling) one")
    ap.add_argument("--steps", type=int, default=steps, help="timed steps (the row gives their median)")
    ap.add_argument("--sides", help="comma-separated subset of the implementations to run (default: all)")
    ap.add_argument("--json", help="also write the table and run details to this path")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # set by the parent for a child: the one side to run
    ap.add_argument("--side-out", help=argparse.SUPPRESS)  # where that child writes its row


def parse_args(ap: Any, argv: list[str], **tiny: Any) -> Any:
    """``argv`` parsed, the ``tiny`` values being the defaults under ``--tiny`` (flags given still win); counts that
    time nothing are refused."""
    if "--tiny" in argv:
        ap.set_defaults(**tiny)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 0:
        ap.error("use --steps >= 1, --warmup >= 0 and --batch >= 0")
    return args


def select_sides(ap: Any, args: Any, sides: dict[str, Any]) -> dict[str, Any]:
    """``sides`` narrowed to ``--sides`` (all when not given); an unknown name is an error naming the known ones."""
    if not args.sides:
        return sides
    wanted = args.sides.split(",")
    unknown = [n for n in wanted if n not in sides]
    if unknown:
        ap.error(f"--sides {args.sides}: unknown {unknown}; choose from {','.join(sides)}")
    return {k: v for k, v in sides.items() if k in wanted}


# ---------------------------------------------------------------- the parent: one child per side
def missing(*modules: str) -> str | None:
    """Why a side cannot run here (its first missing package), else None."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{absent[0]} is not installed" if absent else None


def child_env(jax_on_device: bool) -> dict[str, str]:
    """A side's environment. JAX sides may take 95% of the device (JAX's default is 75%; PyTorch takes what it
    needs); other sides import jax only for configs and keep it on the CPU so it never reserves device memory."""
    env = dict(os.environ)
    if jax_on_device:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    else:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def spawn(script: str, argv: list[str], side: str, batch: int, jax_on_device: bool) -> dict[str, Any]:
    """Run ``script argv --side side --batch batch`` in a child process and return the row it wrote: {"oom": True}
    when it ran out of memory, {"error": ...} when it failed (its traceback is on stderr above)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, script, *argv, "--side", side, "--side-out", out, "--batch", str(batch)]
        print(f"--- {side}, batch {batch}", flush=True)
        rc = subprocess.run(cmd, check=False, env=child_env(jax_on_device)).returncode
        if rc == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return {"error": f"{side} exited with code {rc} (its output is above)"}


def run_sides(script: str, argv: list[str], sides: dict[str, dict[str, Any]], batch: int,
              save: Callable[[dict[str, Any], int], None]) -> tuple[dict[str, Any], int]:
    """Every side at ``batch``, halving it for all when one runs out of memory. ``sides``: name -> {"skip": reason
    or None, "jax": whether it runs JAX on the device}. ``save(rows, batch)`` is called after each side, so a run cut
    short still leaves the rows it finished. Returns (rows by side, the batch they share)."""
    while True:
        rows: dict[str, Any] = {}
        for name, s in sides.items():
            rows[name] = {"skipped": s["skip"]} if s["skip"] else spawn(script, argv, name, batch, s["jax"])
            save(rows, batch)
            if rows[name].get("oom"):
                break
        if not any(r.get("oom") for r in rows.values()) or batch == 1:
            return rows, batch
        print(f"--- out of memory at batch {batch}: every side again at batch {batch // 2}", flush=True)
        batch //= 2


def is_oom(e: BaseException) -> bool:
    """An allocation failure (XLA's RESOURCE_EXHAUSTED, torch.OutOfMemoryError), not a bug."""
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "OutOfMemoryError" in text or "out of memory" in text.lower()


def run_child(args: Any, sides: dict[str, Callable[[Any], dict[str, Any]]]) -> None:
    """The child's whole life: run side ``args.side`` and write its row, or {"oom": True}."""
    try:
        row = sides[args.side](args)
    except Exception as e:  # an OOM is a result (the parent halves the batch); anything else is a failure
        if not is_oom(e):
            raise
        print(f"{args.side}: out of memory at batch {args.batch}: {str(e).splitlines()[0][:300]}", flush=True)
        row = {"oom": True}
    dump(args.side_out, row)


# ---------------------------------------------------------------- inside a side
def timed(step: Callable[[int], float], warmup: int, steps: int,
          mark: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run ``step(i)`` (which returns the loss once the device has finished the step) 1 + warmup + steps times;
    ``mark("first")`` after the first step and ``mark("end")`` after the last (for compile counters)."""
    t0 = time.perf_counter()
    losses = [step(0)]
    first = time.perf_counter() - t0
    mark("first")
    for i in range(1, 1 + warmup):
        losses.append(step(i))
    times = []
    for i in range(1 + warmup, 1 + warmup + steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    mark("end")
    median = statistics.median(times)
    return {"first_step_s": first, "ms_per_step": median * 1e3, "ms_per_step_min": min(times) * 1e3,
            "compile_s": max(first - median, 0.0), "loss_first": losses[0], "loss_last": losses[-1],
            "losses": losses}


class JaxCompiles:
    """XLA compilations and jaxpr traces, counted through `jax.monitoring` (one event per backend compile, with the
    jitted function's name): how many happened by each mark, and the seconds they took."""

    def __init__(self):
        import jax

        self.events: list[tuple[str, str, float]] = []
        self.marks: dict[str, int] = {}
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **kw: Any) -> None:
        if event in (BACKEND_COMPILE, JAXPR_TRACE):
            self.events.append((event, str(kw.get("fun_name", "?")), duration))

    def mark(self, name: str) -> None:
        self.marks[name] = len(self.events)

    def summary(self, step_name: str) -> dict[str, Any]:
        """The first step's compiles (all, and of ``step_name``, the jitted train step), their XLA and trace
        seconds, and the compiles after it (0 when the step compiled once)."""
        start, first, end = self.marks.get("start", 0), self.marks["first"], self.marks["end"]
        in_first = [e for e in self.events[start:first] if e[0] == BACKEND_COMPILE]
        return {"compiles_first_step": len(in_first),
                "step_compiles_first_step": sum(1 for e in in_first if step_name in e[1]),  # "jit(counted_step)"
                "xla_compile_s": sum(e[2] for e in in_first),
                "trace_s": sum(e[2] for e in self.events[start:first] if e[0] == JAXPR_TRACE),
                "compiles_after_first_step": sum(1 for e in self.events[first:end] if e[0] == BACKEND_COMPILE),
                "compiled_functions": sorted({e[1] for e in in_first})}


def time_jaxtune(js: dict[str, Any], host_batches: list[dict[str, Any]], warmup: int, steps: int) -> dict[str, Any]:
    """`timed` for a step from `_harness.jaxtune_step` (``js``) over ``host_batches``, placed on the devices first and
    cycled; with the compile counts (the jitted train step is ``counted_step``), the device and its peak memory."""
    import jax

    from jaxtune import sharding

    compiles = JaxCompiles()
    mesh, train_step, frozen = js["mesh"], js["train_step"], js["frozen"]
    data = [sharding.global_batch(mesh, b) for b in host_batches]
    box = {"state": js["state"]}

    def step(i: int) -> float:
        box["state"], metrics = train_step(box["state"], data[i % len(data)], frozen)
        jax.block_until_ready(box["state"])
        return float(metrics["loss"])

    compiles.mark("start")
    with sharding.use_mesh(mesh):
        timing = timed(step, warmup, steps, compiles.mark)
    return {**jax_device(), **timing, **compiles.summary("counted_step"), **jax_peak_memory(),
            "setup_s": js["setup_s"]}


def torch_update(loss: Any, params: list[Any], opt: Any, device: str) -> float:
    """The rest of a PyTorch step after the forward: backward, gradients clipped at 1.0, the optimizer step; returns
    the loss once the device has finished."""
    import torch

    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return loss.item()


def dynamo_graphs() -> dict[str, int]:
    """torch.compile's work so far: graphs compiled, graph breaks, recompilations (`torch._dynamo` counters)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values()))}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def jax_peak_memory() -> dict[str, Any]:
    """The device's peak bytes in use (the allocator's own count); on CPU, which has none, the process's peak RSS."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and stats.get("peak_bytes_in_use"):
        return {"peak_mem_gb": stats["peak_bytes_in_use"] / 2**30, "peak_mem_source": "jax memory_stats "
                "peak_bytes_in_use"}
    return {"peak_mem_gb": peak_rss_gb(), "peak_mem_source": "process peak RSS (CPU: no device allocator)"}


def torch_peak_memory(device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":
        return {"peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
                "peak_mem_source": "torch.cuda.max_memory_allocated"}
    return {"peak_mem_gb": peak_rss_gb(), "peak_mem_source": "process peak RSS (CPU: no device allocator)"}


def jax_device() -> dict[str, Any]:
    """The device JAX runs on and its peak dense bf16 FLOP/s from jaxtune's table (None: unknown, no MFU)."""
    import jax

    from jaxtune.train.metrics import peak_flops

    d = jax.devices()[0]
    return {"device": d.device_kind, "platform": d.platform, "peak_flops": peak_flops(d)}


def torch_device() -> tuple[str, str]:
    """("cuda", its name) when PyTorch sees a GPU, else ("cpu", "cpu")."""
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name()
    return "cpu", "cpu"


def torch_threads(args: Any) -> None:
    """``--tiny`` on a CPU: one torch thread. It is a smoke test, not a CPU measurement, and with two threads on a
    loaded machine PyTorch's OpenMP workers spin-wait for each other (a 30 ms step took 1.8 s)."""
    import torch

    if args.tiny and not torch.cuda.is_available():
        torch.set_num_threads(1)


def versions(*names: str) -> dict[str, str]:
    """Installed versions of the given distributions (absent ones left out), read without importing them."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


# ---------------------------------------------------------------- data
def random_tokens(seed: int, n: int, batch: int, seq: int, vocab: int) -> list[dict[str, Any]]:
    """``n`` pretraining batches: (B, T) ``inputs`` and next-token ``targets`` from seq + 1 random ids per row."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
        out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    return out


def packed_rows(seed: int, n: int, batch: int, seq: int, vocab: int,
                segments: tuple[int, int] = (3, 8)) -> list[dict[str, Any]]:
    """``n`` packed SFT batches as ``jaxtune.data.sft`` makes them: every (B, T) row is full (no padding) and holds
    ``segments`` (min, max) examples; positions restart at 0 and segment ids count from 1 in each; the loss counts
    the second part (the "completion", 30-70%) of every example. Ids from 1 (0 is often a pad id)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = {k: np.zeros((batch, seq), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
        b["loss_mask"] = np.zeros((batch, seq), np.float32)
        for r in range(batch):
            k = int(rng.integers(segments[0], segments[1] + 1))
            cuts = np.sort(rng.choice(np.arange(1, seq), k - 1, replace=False))
            bounds = [0, *cuts.tolist(), seq]
            for s in range(k):
                lo, hi = bounds[s], bounds[s + 1]
                toks = rng.integers(1, vocab, hi - lo + 1, dtype=np.int32)  # hi - lo + 1 tokens fill hi - lo slots
                b["inputs"][r, lo:hi], b["targets"][r, lo:hi] = toks[:-1], toks[1:]
                b["positions"][r, lo:hi] = np.arange(hi - lo)
                b["segment_ids"][r, lo:hi] = s + 1
                b["loss_mask"][r, lo + int((hi - lo) * rng.uniform(0.3, 0.7)):hi] = 1.0
        out.append(b)
    return out


# ---------------------------------------------------------------- report
def fmt(v: Any, spec: str = ",.0f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def print_table(head: list[str], lines: Iterable[list[str]]) -> None:
    """A markdown table: the first column left-aligned, the rest right-aligned."""
    h.print_header(head)
    for cells in lines:
        print("| " + " | ".join(cells) + " |")


def print_rows(head: list[str], rows: dict[str, dict[str, Any]], labels: dict[str, str],
               cells: Callable[[dict[str, Any]], list[str]]) -> None:
    """`print_table` of one line per side: ``cells(row)`` for a side with numbers, else its label and `status`."""
    print_table(head, [cells(r) if not status(r) else [labels[name], status(r)] + [""] * (len(head) - 2)
                       for name, r in rows.items()])


def status(row: dict[str, Any]) -> str | None:
    """Why a row has no numbers (skipped, out of memory, failed), else None."""
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    if row.get("oom"):
        return "out of memory"
    return row.get("error")


def dump(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
