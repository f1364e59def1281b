"""What every CPU benchmark here shares: the same cores for XLA and torch, implementations timed interleaved in
one process (order rotated every round), medians, and the machine/version record that goes into RESULTS.md.

Scripts run as ``python benchmarks/NAME.py``, so this module imports as ``_harness``.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any


def add_common_args(ap: Any, **shape: int) -> None:
    """The flags every CPU benchmark shares: its model and batch shape (``layers=4, d_model=256, ...`` give the
    flags ``--layers``, ``--d-model`` ... and this script's defaults), ``--threads`` and ``--json``."""
    for name, default in shape.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    ap.add_argument("--threads", type=int, default=None,
                    help="pin the process to this many cores (XLA and torch both use them all); default: all")
    ap.add_argument("--json", help="also write the table and run details to this path")


def add_round_args(ap: Any, rounds: int) -> None:
    """The flags of a benchmark timed in interleaved rounds (`interleave`): ``--rounds`` (default ``rounds``),
    ``--steps`` per implementation per round and ``--warmup`` rounds."""
    ap.add_argument("--rounds", type=int, default=rounds, help="timed rounds (>= 3)")
    ap.add_argument("--steps", type=int, default=2, help="steps per implementation per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first (compiling) step")


def pin_threads(threads: int | None) -> int:
    """Restrict the process to ``threads`` cores (all when None) and give torch as many threads as XLA gets.

    Call before jax creates its CPU client: XLA sizes its intra-op pool from the affinity mask.
    """
    if threads:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    n = len(os.sched_getaffinity(0))
    import torch

    torch.set_num_threads(n)
    return n


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads): the work a step costs, contention or not."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_flags() -> str:
    """The CPU's vector extensions as the tables state them beside each figure."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    return ("AVX-512 (" + " ".join(avx512) + ")") if avx512 else ("AVX2, no AVX-512" if "avx2" in flags else "no AVX2")


def lscpu_model() -> str:
    """lscpu's "Model name" (what RESULTS.md puts beside each figure)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def machine() -> str:
    """This machine as RESULTS.md states it beside each figure: lscpu's model, its vector extensions, its cores."""
    return f"{lscpu_model()} ({cpu_flags()}), {os.cpu_count()} cores"


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def first_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its wall seconds: the first step, where jaxtune traces and compiles."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def interleave(impls: dict[Hashable, dict[str, Any]], rounds: Iterable[int],
               timed: Callable[[int], bool]) -> dict[str, Any]:
    """Run each ``impls[name]["fn"](round)`` once per round, rotating the order so no implementation always
    runs first; rounds where ``timed(round)`` append wall and CPU seconds to ``impls[name]["times"/"cpu"]``,
    and every result is appended to ``impls[name]["outputs"]``. Returns the whole run's wall seconds and the
    load average before and after it (other work on the machine skews the figures)."""
    load_before, t_start = os.getloadavg(), time.perf_counter()
    for im in impls.values():
        im.setdefault("times", [])
        im.setdefault("cpu", [])
        im.setdefault("outputs", [])
    names = list(impls)
    for r in rounds:
        k = r % len(names)
        for name in names[k:] + names[:k]:
            c0, t0 = cpu_seconds(), time.perf_counter()
            impls[name]["outputs"].append(impls[name]["fn"](r))
            dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
            if timed(r):
                impls[name]["times"].append(dt)
                impls[name]["cpu"].append(dc)
    return {"seconds": time.perf_counter() - t_start, "load_before": load_before, "load_after": os.getloadavg()}


def save_json(path: str | None, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` written to ``path`` (``--json``) when given; ``result`` back."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def timing_row(im: dict[str, Any], tokens_per_step: int) -> dict[str, float]:
    """Median tokens/s and ms/step, the fastest step, and median CPU ms/step of one implementation."""
    ms = statistics.median(im["times"]) * 1e3
    return {"tokens_per_s": tokens_per_step / (ms / 1e3), "ms_per_step": ms, "ms_per_step_min": min(im["times"]) * 1e3,
            "cpu_ms_per_step": statistics.median(im["cpu"]) * 1e3}


def run_record(**modules: Any) -> dict[str, Any]:
    """Machine and versions (python plus each given module's ``__version__``) for the JSON and RESULTS.md."""
    return {"machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
            "versions": {"python": platform.python_version()} | {k: m.__version__ for k, m in modules.items()}}


def trainer_step(trainer: Any, batches: list[Any]) -> Callable[[], float]:
    """A transformers Trainer's optimizer step as ``Trainer._run_epoch`` takes it, without callbacks and logging, on
    the next of ``batches`` (collated beforehand): ``training_step`` (forward, backward, the trainer's metrics),
    ``_clip_grad_norm``, ``optimizer.step()``, ``lr_scheduler.step()``, ``zero_grad()``; returns the loss."""
    box = {"i": 0}

    def step() -> float:
        model = trainer.model
        loss = trainer.training_step(model, batches[box["i"]])
        trainer._clip_grad_norm(model)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad()
        box["i"] += 1
        return loss.item()

    return step


def say_run(argv: list[str] | None, **modules: Any) -> tuple[str, dict[str, Any], str]:
    """Print the machine, the versions of ``modules`` and the command line; (machine, `run_record`, command)."""
    import sys

    machine = globals()["machine"]()
    record = run_record(**modules)
    command = "PYTHONPATH=src " + " ".join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])])
    print(f"machine: {machine}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()))
    print(f"command: {command}")
    return machine, record, command


def print_losses_and_steps(first: tuple[float, float], theirs: tuple[float, float], ok: bool,
                           rows: dict[str, dict[str, float]]) -> None:
    """The step-1/2 loss check of a benchmark beside TRL, then its table of ``rows`` (`timing_row`s by name)."""
    print(f"check: step-1 loss {first[0]:.7f} (jaxtune) / {theirs[0]:.7f} (TRL), step-2 loss {first[1]:.7f} / "
          f"{theirs[1]:.7f}: {'agree' if ok else 'DISAGREE'}")
    print_header(["implementation", "ms/step (median)", "min", "CPU ms/step"])
    for r in rows.values():
        print(f"| {r['implementation']} | {r['ms_per_step']:.0f} | {r['ms_per_step_min']:.0f} | "
              f"{r['cpu_ms_per_step']:.0f} |")


def finish_two_sided(args: Any, rows: dict[str, dict[str, float]], ours: str, run: dict[str, Any],
                     said: tuple[str, dict[str, Any], str], params: int, losses: dict[str, list[float]], ok: bool,
                     also: str = "") -> dict[str, Any]:
    """The end of a benchmark beside TRL that checks its first losses: the ratio of TRL's median (and fastest) step
    to the ``ours`` row's (then ``also``), the result with its rows, machine (``said``: `say_run`'s), load, losses
    and config saved (``--json``), and a non-zero exit unless the losses agreed (``ok``)."""
    j, t = rows[ours], rows["TRL (eager)"]
    print(f"ratio (TRL ms / jaxtune ms): **{t['ms_per_step'] / j['ms_per_step']:.2f}x** (best step "
          f"{t['ms_per_step_min'] / j['ms_per_step_min']:.2f}x){also}")
    machine, record, command = said
    result = record | {"machine_lscpu": machine, "command": command, "rows": list(rows.values()),
                       "loadavg_before_after": [run["load_before"], run["load_after"]], "losses": losses,
                       "config": vars(args) | {"params": params}}
    save_json(args.json, result)
    if not ok:
        raise SystemExit("the step-1/step-2 losses disagree: the two sides do not compute the same step")
    return result


def jaxtune_step(cfg: Any) -> dict[str, Any]:
    """jaxtune's step exactly as ``train()`` builds it: ``make_state_spec`` → ``init`` / ``load_frozen`` →
    ``jit_steps`` (``jax.jit`` with explicit in/out shardings and the state donated). Returns {"spec", "mesh",
    "state", "frozen", "train_step" (call it under ``sharding.use_mesh(mesh)``), "setup_s" (spec + state)}."""
    import jax

    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.train.objectives import make_objective
    from jaxtune.train.step import jit_steps

    t0 = time.perf_counter()
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    spec = make_state_spec(cfg, None, mesh)
    state = spec.init(cfg.train.seed)
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train)
    frozen = steps.frozen(spec.load_frozen(cfg.train.seed), cfg.train.seed)
    jax.block_until_ready((state, frozen))
    setup_s = time.perf_counter() - t0
    train_step = steps.train
    return {"spec": spec, "mesh": mesh, "state": state, "frozen": frozen, "train_step": train_step,
            "setup_s": setup_s}


def check_rounds(ap: Any, args: Any) -> None:
    """Refuse fewer than 3 timed rounds or no step per round (``add_round_args``' keys)."""
    if args.rounds < 3 or args.steps < 1 or args.warmup < 0:
        ap.error("use at least 3 timed rounds and 1 step per round")


def add_malloc_arg(ap: Any) -> None:
    ap.add_argument("--malloc-arena", action="store_true",
                    help="glibc malloc: one arena, no mmap, no trim (tune_malloc); affects both frameworks; "
                         "RSS can grow")


def tune_malloc() -> None:
    """Keep freed memory in one glibc heap instead of returning it to the OS (``--malloc-arena``; an experiment, not
    advice).

    XLA:CPU allocates the step's whole temp buffer (~420 MB in cpu_step.py) per execution; glibc serves that with a
    fresh mmap each step, so every step pays ~100k page faults (kernel zeroing pages). PyTorch's large
    tensors pay the same way, less often. One arena + no mmap + no trim makes both reuse warm pages, but the
    heap fragments: RSS was seen to grow by a temp buffer at a time (1.0 -> 2.3 GB over 25 steps).
    """
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    ok = libc.mallopt(m_arena_max, 1) and libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, -1)
    if not ok:
        raise RuntimeError("mallopt failed")


def start_trainers(args: Any) -> int:
    """What the benchmarks beside TRL do before building anything: pin ``--threads``, apply ``--malloc-arena``
    (`tune_malloc`) and silence the trainers' chatter; the thread count."""
    threads = pin_threads(args.threads)
    if args.malloc_arena:
        tune_malloc()
    quiet_trainers()
    return threads


def quiet_trainers() -> None:
    """Silence transformers', datasets' and TRL's progress bars and deprecation chatter (the tables are the output)."""
    import warnings

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)  # gradient_checkpointing's rename, peft
    warnings.filterwarnings("ignore", category=UserWarning, module="trl")


PAD, BOS, EOS = 0, 1, 2  # the word tokenizer's special ids


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ids 0..V-1 (w3 ... w{V-1}): texts of space-separated words encode to exactly their
    ids, and every id decodes (TRL's trainers want a tokenizer; the timed batches are made of ids)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def print_header(head: list[str], text_columns: int = 1) -> None:
    """A markdown table's header: ``head``, its first ``text_columns`` columns left-aligned, the rest right."""
    print("\n| " + " | ".join(head) + " |")
    print("|" + "|".join("-" * (len(h) + 1) + (":" if i >= text_columns else "-") for i, h in enumerate(head)) + "|")


def say_noisy(rows: Iterable[dict[str, Any]], load1: float) -> None:
    """Flag the implementations whose median step is over 1.3x their fastest: other work on the machine (PyTorch's
    OpenMP threads suffer most), at 1-minute load average ``load1``."""
    noisy = [r["implementation"] for r in rows if r["ms_per_step"] > 1.3 * r["ms_per_step_min"]]
    if noisy:
        print(f"noisy: median > 1.3x the fastest step for {noisy} (load average {load1:.1f} on {os.cpu_count()} cores)")
