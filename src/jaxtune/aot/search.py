"""How far a run can go on a TPU slice, found by compiling: the largest global batch (`largest_batch`, ``info
--max-batch``) and the longest sequence (`longest_sequence`, ``info --max-seq``; for GRPO the longest completion
after the run's prompts) that the compiler accepts within the chip's HBM. Both walk one integer (`settle`): doubling
from the run's own setting until a candidate is refused (halving if that one was), then bisection, until the
compile-time budget is spent."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jaxtune.aot.sampler import compile_sampler
from jaxtune.aot.step import Program, program
from jaxtune.config import Config, ConfigError

SEQ_UNIT = 256  # sequence lengths are searched in multiples of this (and of mesh.context, which splits them)


def settle(k: int, k_fits: bool, fits: Callable[[int], bool], out_of_time: Callable[[], bool],
           cap: int | None = None) -> tuple[int, int | None]:
    """(largest k known to fit (0: none), smallest k known refused (None: none met)) for a monotone ``fits``, from
    ``k`` already tried (``k_fits``): doubling up to ``cap`` (the largest k allowed at all) while k fits, halving
    while it does not, then bisection, each until ``out_of_time()``."""
    lo, hi = (k, None) if k_fits else (0, k)
    while not out_of_time() and ((hi is None and lo < (cap or math.inf)) or (hi is not None and lo == 0 and hi > 1)):
        k = min(lo * 2, cap or math.inf) if hi is None else hi // 2
        if fits(k):
            lo = k
        else:
            hi = k
    while not out_of_time() and hi is not None and hi - lo > 1:
        k = (lo + hi) // 2
        lo, hi = (k, hi) if fits(k) else (lo, k)
    return lo, hi


def largest_batch(p: Program, first: dict[str, Any], budget_seconds: float) -> dict[str, Any]:
    """The largest global batch (a multiple of `Program.batch_unit`) the compiler accepts within the slice's HBM,
    compiling each candidate from the compiled ``first`` batch. ``exact``: the neighbours were settled (the next
    multiple was refused); ``tried``: (batch, fits, bytes per chip) of each compile, in order (a refused one's bytes
    are at least what the compiler asked for)."""
    unit, spent = p.batch_unit, [first["compile_seconds"]]
    tried = [(first["batch_size"], first["fits"], first["memory"]["total"])]

    def fits(k: int) -> bool:
        r = p.compile(k * unit)
        spent.append(r["compile_seconds"])
        tried.append((k * unit, r["fits"], r["memory"]["total"]))
        return r["fits"]

    lo, hi = settle(first["batch_size"] // unit, first["fits"], fits, lambda: sum(spent) >= budget_seconds)
    return {"batch_size": lo * unit or None, "refused": hi * unit if hi else None, "unit": unit,
            "exact": hi is not None and hi - lo == 1, "compiles": len(tried), "compile_seconds": sum(spent),
            "tried": tried}


def sequence_room(p: Program) -> tuple[int, int, int]:
    """(the search's step in tokens, the prompt room before the searched tokens, the most steps the model's context
    holds) of `longest_sequence` on ``p``. A context that holds no step is a `ConfigError` naming the keys: the run's
    own length (a recipe's ``data.seq_len`` under 256) is planned without a search, and a search needs a context of
    at least one step more."""
    cfg = p.cfg
    samples = cfg.objective.generates
    prompt = cfg.max_prompt_tokens if samples else 0
    unit = math.lcm(SEQ_UNIT, p.mesh.shape["context"])
    context = p.steps.spec.model_cfg.max_seq_len
    cap = (context - prompt) // unit
    if cap < 1:
        step = f"{unit} tokens" + (f" ({SEQ_UNIT} and a multiple of mesh.context={p.mesh.shape['context']})"
                                   if unit != SEQ_UNIT else "")
        what = (f"objective.max_completion_length in steps of {step}, after the prompts' {prompt} tokens (data.seq_len"
                f"={cfg.data.seq_len} - objective.max_completion_length={cfg.objective.max_completion_length})"
                if samples else f"data.seq_len in steps of {step}")
        raise ConfigError(f"--max-seq searches {what}, up to the model's context of {context} tokens "
                          f"(model.max_seq_len), which holds no step: the run's own data.seq_len={cfg.data.seq_len} is "
                          f"planned without --max-seq (drop it), or raise model.max_seq_len to at least "
                          f"{prompt + unit} to search")
    return unit, prompt, cap


def longest_sequence(p: Program, budget_seconds: float) -> dict[str, Any]:
    """The longest sequence (``data.seq_len``, multiples of `SEQ_UNIT` and of ``mesh.context``) whose train step
    fits the slice's HBM at the run's batch, up to the model's own context (``max_seq_len``). For an objective that
    samples (GRPO) the longest completion (``objective.max_completion_length``) after the run's prompt room
    (``data.seq_len - max_completion_length``), where both the train step and the sampler (its KV cache beside the
    resident state) must fit. Each candidate is the run's program rebuilt at that length and compiled; ``tried``:
    (tokens, fits, bytes per chip: the larger of step and sampler) in order."""
    cfg, spent = p.cfg, []
    samples = cfg.objective.generates
    unit, prompt, cap = sequence_room(p)
    start = cfg.objective.max_completion_length if samples else cfg.data.seq_len
    tried: list[tuple[int, bool, float | None]] = []

    def fits(k: int) -> bool:
        q = program(_at_length(cfg, k * unit, prompt), p.slice.name)
        r = q.compile(cfg.train.batch_size)
        spent.append(r["compile_seconds"])
        ok, total = r["fits"], r["memory"]["total"]
        if samples and ok:
            s = compile_sampler(q)
            spent.append(s["compile_seconds"])
            ok, total = s["fits"], max(total, s["total"])
        tried.append((k * unit, ok, total))
        return ok

    k0 = max(start // unit, 1)
    lo, hi = settle(k0, fits(k0), fits, lambda: sum(spent) >= budget_seconds, cap)
    return {"tokens": lo * unit or None, "refused": hi * unit if hi else None, "unit": unit,
            "completion": samples, "prompt_tokens": prompt, "capped": lo == cap and hi is None,
            "model_max_seq_len": p.steps.spec.model_cfg.max_seq_len, "batch_size": cfg.train.batch_size,
            "exact": hi is not None and hi - lo == 1, "compiles": len(tried), "compile_seconds": sum(spent),
            "tried": tried}


def _at_length(cfg: Config, tokens: int, prompt: int) -> Config:
    """``cfg`` with sequences of ``tokens`` (a sampling objective: completions of ``tokens`` after ``prompt``)."""
    data = cfg.data.model_copy(update={"seq_len": prompt + tokens})
    if not cfg.objective.generates:
        return cfg.model_copy(update={"data": data})
    objective = cfg.objective.model_copy(update={"max_completion_length": tokens})
    return cfg.model_copy(update={"data": data, "objective": objective})
