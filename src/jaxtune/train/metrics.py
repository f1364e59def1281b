"""What a run reports: the per-step log (`StepLog`: metric windows, the NaN policy's verdict, every sink), the writers
behind it (a progress bar, ``metrics.jsonl``, TensorBoard and, when configured, W&B), and the run's closing files.

Only process 0 writes. A resumed run redoes the steps after its checkpoint: the rows an earlier attempt wrote for
them are removed first (`MetricsWriter`), so each step has one row and TensorBoard one curve. A write that fails on
a full or read-only disk is one `WriteError` line naming the file.

MFU is model FLOPs per second over the devices' peak dense bf16 FLOP/s, from the table below (datasheet figures, no
sparsity); device kinds not in the table report no MFU rather than a guess.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxtune.config import Config, LoggingConfig
from jaxtune.io import write_text_atomically
from jaxtune.job.run_dir import writing
from jaxtune.train.objectives.base import COUNT_SUFFIX, present, with_margins
from jaxtune.train.shapes import Shape

# Step metrics the loop handles itself; every other key of the step's metrics (the objective's) is logged as is.
_STEP_KEYS = ("loss", "grad_norm", "lr", "count", "finite", "nan_streak")


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/Inf loss or gradient; the last good checkpoint is kept."""


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(50) so a diverged loss still prints."""
    return math.exp(min(loss, 50.0))

# Peak dense bf16 FLOP/s per device, from vendor datasheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # Trillium / v6e
    "TPU v6e": 918e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100": 312e12,
}


def peak_flops(device: Any) -> float | None:
    kind = getattr(device, "device_kind", "")
    if kind in PEAK_FLOPS:
        return PEAK_FLOPS[kind]
    matches = [v for k, v in PEAK_FLOPS.items() if kind.startswith(k)]
    return matches[0] if matches else None


EVALS_FILE = "evals.jsonl"  # every evaluation's record (the Evaluator's), so report.md spans resumes


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (a line that is not JSON is skipped); [] without the file."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def drop_rows_from(path: Path, first: int) -> None:
    """Rewrite the JSON-lines file ``path`` (atomically, only if needed) without its rows of step ``first`` and later,
    and without a last line cut short by a killed writer."""
    if not path.is_file():
        return
    with writing(path):
        lines = path.read_text().splitlines(keepends=True)
        keep = []
        for line in lines:
            try:
                if json.loads(line)["step"] < first:
                    keep.append(line.rstrip("\n") + "\n")
            except (ValueError, KeyError, TypeError):
                if line.endswith("\n"):
                    keep.append(line)  # not a row of ours: kept
        if keep != lines:
            write_text_atomically(path, "".join(keep))


PLAIN_EVERY = 30.0  # seconds between progress lines when stderr is not a terminal (a redirected log)

# JAX's monitoring events that time making a program: tracing, lowering, and the compile (or the cache's read).
COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"})
_compiling = [0.0, False]  # seconds this process has spent making programs; whether the listener is registered


def _count_compile(event: str, seconds: float, **_: Any) -> None:
    if event in COMPILE_EVENTS:
        _compiling[0] += seconds


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling programs since the first call (a clock:
    compare two readings). One listener for the process, so that runs that end in an error leave none behind."""
    if not _compiling[1]:
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _compiling[1] = True
    return _compiling[0]


class PlainProgress:
    """Without a terminal (a log file): a line every `PLAIN_EVERY` seconds with the step, the time a step takes and
    the time left. Both are measured from the first step done here on, less the time spent making programs
    meanwhile (a new length bucket's, the eval step's, the sampler's): each is made once, so counting it would
    stretch the time left over every remaining step (the first step's compile alone made "65.9 min left" of a
    2-minute run)."""

    def __init__(self, step: int, total: int):
        self.step, self.total = step, total
        self.last_line = time.perf_counter()
        self.since: tuple[int, float, float] | None = None  # (step, time, compile_seconds()) at the first step here

    def advance(self, n: int) -> None:
        self.step += n
        now = time.perf_counter()
        if self.since is None:
            self.since = (self.step, now, compile_seconds())
        if now - self.last_line < PLAIN_EVERY or self.step >= self.total:
            return
        self.last_line = now
        line = f"progress: step {self.step}/{self.total} ({self.step / max(self.total, 1):.0%})"
        first, then, compiled = self.since
        if self.step > first:
            per_step = max(now - then - (compile_seconds() - compiled), 0.0) / (self.step - first)
            line += f", {per_step:.2f} s/step, about {(self.total - self.step) * per_step / 60:.1f} min left"
        print(line, flush=True)


class MetricsWriter:
    """Writes scalars for a step to every configured sink (process 0 only).

    A run that starts at ``start_step`` writes rows from step ``start_step + 1`` on (from 0, its baseline evaluation,
    when it starts from scratch): the rows an earlier attempt left from there on are removed from metrics.jsonl and
    samples.jsonl (the `Evaluator`'s), and TensorBoard is told to purge its events from there on (``purge_step``)."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, start_step: int, config: dict[str, Any]):
        self.enabled = jax.process_index() == 0
        self.bar = self.jsonl = self.tb = self.wandb = None
        self.plain: PlainProgress | None = None  # without a terminal
        self._bar_from: tuple[int, int] | None = None  # a terminal: (total, initial) of the bar the first step draws
        if not self.enabled:
            return
        first = start_step + 1 if start_step else 0
        for name in ("metrics.jsonl", "samples.jsonl", EVALS_FILE):
            drop_rows_from(run_dir / name, first)
        if cfg.progress and sys.stderr.isatty():  # drawn at the first step: what comes before has bars of its own
            self._bar_from = (total_steps, start_step)
        elif cfg.progress:  # a log file: a plain line every PLAIN_EVERY seconds, never a redrawn bar
            self.plain = PlainProgress(start_step, total_steps)
        self.jsonl_path = run_dir / "metrics.jsonl"
        if cfg.jsonl:
            with writing(self.jsonl_path):
                self.jsonl = open(self.jsonl_path, "a", buffering=1)  # noqa: SIM115 (open for the run; close())
        if cfg.tensorboard:
            SummaryWriter = _summary_writer()
            with writing(run_dir / "tensorboard"):
                self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first)
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("logging.wandb_project is set but wandb is not installed: "
                                  "pip install 'jaxtune[wandb]'") from None
            self.wandb = wandb.init(project=cfg.wandb_project, dir=str(run_dir), config=config, resume="allow")

    def write(self, step: int, scalars: dict[str, float], kind: str = "train") -> None:
        if not self.enabled:
            return
        if self.jsonl:
            with writing(self.jsonl_path):
                self.jsonl.write(json.dumps({"step": step, "kind": kind, "time": time.time(), **scalars}) + "\n")
        if self.tb:
            for k, v in scalars.items():
                self.tb.add_scalar(f"{kind}/{k}", v, step)
            self.tb.flush()  # as durable as metrics.jsonl's line: a killed run's curve ends where its rows do
        if self.wandb:
            self.wandb.log({f"{kind}/{k}": v for k, v in scalars.items()}, step=step)
        if kind == "train":
            self._draw_bar()
        if self.bar and kind == "train":
            shown = {k: scalars[k] for k in ("loss", "lr", "tok_s") if k in scalars}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)

    def _draw_bar(self) -> None:
        if self.bar is None and self._bar_from is not None:
            from tqdm.auto import tqdm

            total, initial = self._bar_from
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        self._draw_bar()
        if self.bar:
            self.bar.update(n)
        elif self.plain:
            self.plain.advance(n)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.jsonl:
            with writing(self.jsonl_path):
                self.jsonl.close()
        for sink in (self.bar, self.tb):
            if sink:
                sink.close()
        if self.wandb:
            self.wandb.finish()


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX.writer imports torch when it is installed
    (only to accept torch tensors, which we never pass), and that costs ~2 s of every run's start. A torch already
    imported (the torchax backend) is left alone."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter


@dataclass(frozen=True)
class NonFinite:
    """A step whose loss or gradient was not finite and that stops training: ``train.on_nan=abort``, or
    ``train.max_nan_skips`` skipped in a row (``streak``, with ``train.on_nan=skip``). The loop waits for the
    checkpoint being written, then raises `error` with the last good step."""

    step: int
    loss: float
    grad_norm: float
    streak: int = 0  # skipped steps in a row; 0 where train.on_nan=abort
    max_skips: int = 0

    def error(self, last_good: int | None) -> NonFiniteLossError:
        if not self.streak:
            return NonFiniteLossError(
                f"step {self.step}: loss={self.loss} grad_norm={self.grad_norm}; training stopped, last good "
                f"checkpoint: {last_good}. Set train.on_nan=skip to skip such steps.")
        return NonFiniteLossError(
            f"step {self.step}: {self.streak} non-finite steps in a row (train.max_nan_skips={self.max_skips}); last "
            f"good checkpoint: {last_good}")


class CountedMeans:
    """The means of the metrics with units of their own (a count beside each, `count_key`) over a logging window's
    finite steps: each step weighted by its count, so a step without such units adds nothing and a metric without
    any in the window is absent (never 0, nor a mean of per-step means)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, m: dict[str, float]) -> None:
        """A finite step's metrics ``m`` (means, and counts under `count_key`)."""
        for key, n in m.items():
            if key.endswith(COUNT_SUFFIX) and n > 0:
                name = key.removesuffix(COUNT_SUFFIX)
                self.sums[name] = self.sums.get(name, 0.0) + m[name] * n
                self.counts[name] = self.counts.get(name, 0.0) + n

    def logged(self, m: dict[str, float], finite_steps: int) -> dict[str, float]:
        """What a train row logs of the last step's objective metrics ``m``: each as the step gave it, those with
        units of their own as the window's means instead (the step's own where the window had no finite step, as
        the loss does), without the counts; ``rewards/margins`` where both rewards are (`with_margins`)."""
        own = {k: v for k, v in m.items() if k not in _STEP_KEYS}
        if not finite_steps:
            return with_margins(present(own))
        counted = {k.removesuffix(COUNT_SUFFIX) for k in own if k.endswith(COUNT_SUFFIX)}
        plain = {k: v for k, v in present(own).items() if k not in counted}
        return with_margins({**plain, **{k: s / self.counts[k] for k, s in self.sums.items()}})


class StepLog:
    """The train steps' metrics, read one step late (so dispatch stays asynchronous): the NaN policy
    (``train.on_nan``), means over each logging window, throughput and MFU, written every ``logging.every`` steps.

    ``push(step, metrics, shape)`` after each step reads the previous step's metrics (the only host sync per step);
    ``drain()`` reads everything pending (before a checkpoint or an evaluation). Both return the `NonFinite` step
    that stops training, if the NaN policy says so (None: go on); the loop stops.

    Throughput counts real tokens: ``tokens`` is the step's tokens that are not padding, ``tok_s`` the window's real
    tokens per second, ``pad_fraction`` the share of the positions stepped that were padding, and MFU the model FLOPs
    of the real tokens (at the length they were stepped at) per second over the devices' peak. The objective's own
    count (tokens with loss, pairs, completion tokens) is ``count``. Its metrics are the logged step's, but those with
    units of their own (KTO's rewards of desirable or undesirable rows, GRPO's per-token ones) are means over the
    window's units (`CountedMeans`), absent where it had none."""

    def __init__(self, run_dir: Path, cfg: Config, start: int, model_cfg: Any):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.writer = MetricsWriter(run_dir, cfg.logging, cfg.train.steps, start, cfg.to_dict())
        self.peak = peak_flops(jax.devices()[0])
        self.losses: dict[int, float] = {}  # step -> train loss, for the steps run here
        self.nan_skipped = 0
        self.pending: list[tuple[int, dict[str, Any], Shape]] = []
        self._window(time.perf_counter())

    def _window(self, t0: float) -> None:
        self.t0, self.steps, self.loss_sum, self.finite = t0, 0, 0.0, 0
        self.counted = CountedMeans()
        self.tokens, self.positions, self.flops = 0, 0, 0.0

    def message(self, text: str) -> None:
        self.writer.message(text)

    def push(self, step: int, metrics: dict[str, Any], shape: Shape) -> NonFinite | None:
        stop = self.drain()
        self.pending.append((step, metrics, shape))
        self.writer.advance()
        return stop

    def drain(self) -> NonFinite | None:
        while self.pending:
            step, m, shape = self.pending.pop(0)
            stop = self._read(step, {k: float(v) for k, v in jax.device_get(m).items()}, shape)
            if stop is not None:
                return stop
        return None

    def _read(self, s: int, m: dict[str, float], shape: Shape) -> NonFinite | None:
        self.losses[s] = m["loss"]
        if not m["finite"]:
            stop = self._non_finite(s, m)
            if stop is not None:
                return stop
        self.steps += 1
        self.tokens += shape.tokens
        self.positions += shape.positions
        self.flops += self.model_cfg.flops_per_token(shape.length) * shape.tokens
        if m["finite"]:
            self.loss_sum += m["loss"]
            self.finite += 1
            self.counted.add(m)
        if s % self.cfg.logging.every and s != self.cfg.train.steps:
            return None
        elapsed = time.perf_counter() - self.t0
        step_time = elapsed / max(self.steps, 1)
        # loss: mean over the steps since the last line (steady curves); step_loss: this step's
        scalars = {"loss": self.loss_sum / self.finite if self.finite else m["loss"], "step_loss": m["loss"],
                   "lr": m["lr"], "grad_norm": m["grad_norm"], "tokens": shape.tokens, "count": m["count"],
                   **self.counted.logged(m, self.finite),
                   "step_time": step_time, "tok_s": self.tokens / elapsed,
                   "pad_fraction": 1.0 - self.tokens / max(self.positions, 1)}
        if self.peak:
            scalars["mfu"] = self.flops / elapsed / (self.peak * jax.device_count())
        self.writer.write(s, scalars)
        self._window(time.perf_counter())
        return None

    def _non_finite(self, s: int, m: dict[str, float]) -> NonFinite | None:
        """The NaN policy's verdict on step ``s``: a skipped step is counted and said; the step that stops training
        is returned."""
        train = self.cfg.train
        if train.on_nan == "abort":
            return NonFinite(s, m["loss"], m["grad_norm"])
        self.nan_skipped += 1
        streak = int(m["nan_streak"])
        self.message(f"step {s}: non-finite loss, update skipped ({streak} in a row)")
        return NonFinite(s, m["loss"], m["grad_norm"], streak, train.max_nan_skips) \
            if m["nan_streak"] >= train.max_nan_skips else None

    def close(self) -> None:
        self.writer.close()


class Laps:
    """Where a run's wall time goes: ``lap(phase)`` adds the time since the previous lap to ``phase``.

    The loop's phases: ``setup`` (checkpoint scan, data, model, restore), ``compile`` (the first step's dispatch,
    which compiles it), ``steps`` (read at a host sync: before an evaluation, a save or the end), ``eval`` (with the
    eval step's compile), ``save`` (the blocking part of a save: the copy to host; the write runs beside the steps)
    and ``finish`` (the last save's wait, plot, report). summary.json gets them as ``seconds``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.t
        self.t = now

    def line(self) -> str:
        total = sum(self.seconds.values())
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.seconds.items())
        steps = self.seconds.get("steps", 0.0)
        outside = 100 * (1 - steps / total) if total else 0
        return f"time: {total:.1f} s in train(): {parts} s; {outside:.1f}% outside steps"


@dataclass(frozen=True)
class ParameterCount:
    """A run's size, said the same way at its start and at its end: ``total``, every parameter once at its logical
    size (LoRA adapters included, a quantized kernel as the weights it stands for, not its stored blocks and scales);
    ``trained``, those the optimizer updates."""

    total: int
    trained: int

    def __str__(self) -> str:
        return f"{self.total / 1e6:.2f}M parameters, {self.trained / 1e6:.3g}M trained"


def write_summary(run_dir: Path, summary: dict[str, Any], preempted: bool) -> None:
    """summary.json, and (unless preempted) the closing lines on stdout (process 0)."""
    with writing(run_dir / "summary.json"):
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if preempted:
        return
    ev = f", validation loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
    tl = f", train loss {summary['final_train_loss']:.4f}" if summary["final_train_loss"] is not None else ""
    size = ParameterCount(summary["params"], summary["trained_params"])
    print(f"done: step {summary['step']}{tl}{ev}; {size}\n"
          f"run directory: {run_dir} (checkpoints/, metrics.jsonl, loss.png, samples.jsonl, tensorboard/)", flush=True)


def write_loss_plot(run_dir: Path) -> None:
    """loss.png from metrics.jsonl (process 0)."""
    with writing(run_dir / "loss.png"):
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")


def prefetch_plotting() -> None:
    """Import matplotlib in a background thread while the steps run (the import is most of the ~0.8 s that
    loss.png costs at the end of a run; the steps wait on XLA, not on Python)."""
    threading.Thread(target=_pyplot, daemon=True, name="jaxtune-prefetch-matplotlib").start()


def _pyplot() -> Any:
    """matplotlib.pyplot, drawing to files (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(metrics_path: Path, out: Path) -> Path | None:
    """Loss curve (train and validation) from metrics.jsonl as a PNG."""
    if not metrics_path.exists():
        return None
    plt = _pyplot()
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        pts = sorted({r["step"]: r["loss"] for r in rows if r.get("kind") == kind and "loss" in r}.items())
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=kind)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
