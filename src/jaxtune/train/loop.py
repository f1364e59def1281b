"""``train(cfg)``: the training loop, top to bottom.

run directory → mesh → data → model/optimizer/shardings → restore or init → step → loop → final report.
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from jaxtune.config import Config, ConfigError, dump_config, identity_diff
from jaxtune.data import load_tokenizer, make_training_data
from jaxtune.generate import encode_prompt, stop_ids
from jaxtune.train import distributed, sharding
from jaxtune.train.checkpoint import Checkpointer
from jaxtune.train.metrics import MetricsWriter, peak_flops, plot_loss
from jaxtune.train.state import build_steps, make_state_spec


class NonFiniteLossError(RuntimeError):
    """Training hit a NaN/Inf loss or gradient; the last good checkpoint is kept."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss, for the steps run here
    eval_loss: float | None = None
    step_compiles: int = 0
    nan_skipped: int = 0
    preempted: bool = False
    samples: list[str] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "loss", "samples"} per evaluation


class _Preemption:
    """SIGTERM stops the run at a step boundary with a checkpoint.

    One process: a SIGTERM handler sets a flag. Several (jax.distributed): JAX's preemption service already
    listens for SIGTERM on every host and agrees on one step for all of them
    (`multihost_utils.reached_preemption_sync_point`, asked at every step), so every host saves the same step.
    """

    def __init__(self, multi_host: bool):
        self.multi_host = multi_host
        self.requested = False
        self._previous = None

    def __enter__(self):
        if not self.multi_host:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                self._previous = None
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to save and stop after ``step``; call it once per step, on every host."""
        if self.multi_host:
            from jax.experimental import multihost_utils

            self.requested = self.requested or multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def train(cfg: Config) -> TrainResult:
    """Train (or resume) the run described by ``cfg``; re-running the same config resumes it."""
    multi_host = distributed.initialize(cfg.distributed)  # before anything touches a device
    run_dir = cfg.run_path
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.train.compile_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(Path(cfg.train.compile_cache_dir).expanduser()))

    # Checkpoints first: resuming with a different model/data/seed is refused before any work is done.
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    start = ckpt.latest_step() or 0
    if start:
        diff = identity_diff(ckpt.read_config(start), cfg.to_dict())
        if diff:
            raise ConfigError(
                f"{run_dir} holds a checkpoint (step {start}) of a different run; these keys differ:\n  "
                + "\n  ".join(diff)
                + "\nUse another run_dir (or name), or restore the original values."
            )
    if jax.process_index() == 0:
        dump_config(cfg, run_dir / "config.yaml")

    # Mesh.
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    n_proc, proc = jax.process_count(), jax.process_index()

    # Data.
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.data)
    data = make_training_data(cfg.data, tokenizer, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                              eval_batches=cfg.eval.batches, process_index=proc, process_count=n_proc)
    train_iter, eval_batches = data.train_iter, data.eval_batches
    if proc == 0:
        tokenizer.save(run_dir / "tokenizer")  # after the data: fine-tuning data may set its chat template

    # Model, optimizer, shardings.
    spec = make_state_spec(cfg, tokenizer.vocab_size, mesh)
    check_context(cfg, spec.model_cfg)

    # Restore or init. Frozen params (a LoRA base) are not in the checkpoint: they are read again.
    if start:
        state, data_state = ckpt.restore(start, spec.abstract)
        train_iter.set_state(data_state)
    else:
        state = spec.init(cfg.train.seed)
    frozen = spec.load_frozen(cfg.train.seed)

    # The step, jitted once: state donated, shardings explicit.
    traces = [0]
    step_impl, eval_impl = build_steps(spec, cfg.train)

    def counted_step(state, batch, frozen):
        traces[0] += 1
        return step_impl(state, batch, frozen)

    batch_sh = sharding.batch_sharding(mesh)
    train_step = jax.jit(counted_step, in_shardings=(spec.shardings, batch_sh, spec.frozen_shardings),
                         out_shardings=(spec.shardings, sharding.replicated(mesh)), donate_argnums=0)
    eval_step = jax.jit(eval_impl, in_shardings=(spec.shardings.params, batch_sh, spec.frozen_shardings))
    generator = spec.generator()
    chat = cfg.data.format not in ("text", "prompt_completion") and tokenizer.chat_template is not None

    # Loop.
    total = cfg.train.steps
    writer = MetricsWriter(run_dir, cfg.logging, total, start, cfg.to_dict())
    result = TrainResult(run_dir=run_dir, step=start)
    if start:
        writer.message(f"resumed from {ckpt.directory / str(start)} (step {start}/{total})")
    for moved in ckpt.set_aside:
        writer.message(f"ignored an unfinished checkpoint, moved to {moved}")
    for line in data.report:
        writer.message(line)
    flops_per_step = spec.model_cfg.flops_per_token(cfg.data.seq_len) * cfg.train.batch_size * cfg.data.seq_len
    peak = peak_flops(jax.devices()[0])
    pending: list[tuple[int, dict[str, Any]]] = []  # device metrics not yet read (one-step lag keeps dispatch async)
    window = {"t0": time.perf_counter(), "steps": 0, "loss": 0.0, "finite": 0}  # since the last log line

    def drain() -> None:
        """Read pending metrics: log, and apply the NaN policy (this is the only host sync per step)."""
        while pending:
            s, m = pending.pop(0)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            result.losses[s] = m["loss"]
            if not m["finite"]:
                if cfg.train.on_nan == "abort":
                    ckpt.wait()
                    raise NonFiniteLossError(
                        f"step {s}: loss={m['loss']} grad_norm={m['grad_norm']}; training stopped, last good "
                        f"checkpoint: {ckpt.latest_step()}. Set train.on_nan=skip to skip such steps.")
                result.nan_skipped += 1
                writer.message(f"step {s}: non-finite loss, update skipped ({int(m['nan_streak'])} in a row)")
                if m["nan_streak"] >= cfg.train.max_nan_skips:
                    ckpt.wait()
                    raise NonFiniteLossError(
                        f"step {s}: {int(m['nan_streak'])} non-finite steps in a row "
                        f"(train.max_nan_skips={cfg.train.max_nan_skips}); last good checkpoint: {ckpt.latest_step()}")
            window["steps"] += 1
            if m["finite"]:
                window["loss"] += m["loss"]
                window["finite"] += 1
            if s % cfg.logging.every == 0 or s == total:
                dt = time.perf_counter() - window["t0"]
                step_time = dt / max(window["steps"], 1)
                mean_loss = window["loss"] / window["finite"] if window["finite"] else m["loss"]
                # loss: mean over the steps since the last line (steady curves); step_loss: this step's
                scalars = {"loss": mean_loss, "step_loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                           "tokens": m["tokens"], "step_time": step_time,
                           "tok_s": cfg.train.batch_size * cfg.data.seq_len / step_time}
                if peak:
                    scalars["mfu"] = flops_per_step / step_time / (peak * jax.device_count())
                writer.write(s, scalars)
                window.update(t0=time.perf_counter(), steps=0, loss=0.0, finite=0)

    def run_eval(step: int) -> None:
        record: dict[str, Any] = {"step": step, "loss": None, "samples": []}
        if eval_batches:
            sums = [jax.device_get(eval_step(state.params, sharding.global_batch(mesh, b), frozen))
                    for b in eval_batches]
            loss = sum(float(a) for a, _ in sums) / max(sum(float(n) for _, n in sums), 1.0)
            result.eval_loss = record["loss"] = loss
            writer.write(step, {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}, kind="eval")
            writer.message(f"step {step}: validation loss {loss:.4f}, perplexity {math.exp(min(loss, 50.0)):.2f}")
        if cfg.eval.prompts:
            ids = generator(spec.weights(state.params, frozen),
                            [encode_prompt(tokenizer, p, chat) for p in cfg.eval.prompts],
                            max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature,
                            top_k=cfg.eval.top_k, top_p=cfg.eval.top_p, eos_id=stop_ids(tokenizer, chat), seed=step)
            result.samples = record["samples"] = [
                (f"user: {p}\nassistant: " if chat else p) + tokenizer.decode(x) for p, x in zip(cfg.eval.prompts, ids)]
            if proc == 0:
                with open(run_dir / "samples.jsonl", "a") as f:
                    f.writelines(json.dumps({"step": step, "text": text}) + "\n" for text in result.samples)
            for text in result.samples:
                writer.message(f"--- sample @ step {step} ---\n{text}")
        result.evals.append(record)

    def save(step: int) -> None:
        drain()  # never save a state whose loss has not been checked
        ckpt.save(step, state, train_iter.get_state(), cfg.to_dict())

    with _Preemption(multi_host) as preemption, sharding.use_mesh(mesh):
        step = start
        if start == 0 and (eval_batches or cfg.eval.prompts):
            run_eval(0)  # the baseline the run report compares against
        while step < total:
            batch = sharding.global_batch(mesh, next(train_iter))
            state, metrics = train_step(state, batch, frozen)
            step += 1
            drain()
            pending.append((step, metrics))
            writer.advance()
            if cfg.eval.every and step % cfg.eval.every == 0 and step < total:
                drain()
                run_eval(step)
            stop = preemption.reached(step)
            if step % cfg.checkpoint.every == 0 or step == total or stop:
                save(step)
            if stop:
                writer.message(f"SIGTERM: saved step {step}, exiting; re-run the same command to resume")
                result.preempted = True
                break
        drain()
        result.step = step
        if step == total:
            if ckpt.latest_step() != total:
                save(total)
            run_eval(total)
    ckpt.close()
    if hasattr(train_iter, "close"):  # Grain worker processes, when data.num_workers > 0
        train_iter.close()
    result.step_compiles = traces[0]
    writer.close()
    if proc == 0:
        plot_loss(run_dir / "metrics.jsonl", run_dir / "loss.png")
        summary = {"step": result.step, "final_train_loss": result.losses.get(result.step),
                   "eval_loss": result.eval_loss, "nan_skipped": result.nan_skipped, "preempted": result.preempted,
                   "params": spec.model_cfg.num_params(), "step_compiles": result.step_compiles}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if result.evals:
            _write_report(run_dir / "report.md", result.evals)
        if not result.preempted:
            print(_summary_text(run_dir, summary), flush=True)
    return result


def check_context(cfg: Config, model_cfg: Any) -> None:
    if model_cfg.max_seq_len < cfg.data.seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's context "
                          f"(model.max_seq_len={model_cfg.max_seq_len}); lower data.seq_len or raise max_seq_len")


def _write_report(path: Path, evals: list[dict[str, Any]]) -> None:
    """report.md: held-out loss at every evaluation, and the samples of the first and last one side by side
    (appended to on resume, so a resumed run keeps its baseline)."""
    lines = [] if path.exists() else ["# Run report", ""]
    losses = [e for e in evals if e["loss"] is not None]
    if losses:
        lines += ["| step | held-out loss | perplexity |", "|--:|--:|--:|"]
        lines += [f"| {e['step']} | {e['loss']:.4f} | {math.exp(min(e['loss'], 50.0)):.2f} |" for e in losses]
        lines.append("")
    first, last = evals[0], evals[-1]
    if last["samples"]:
        for k, after in enumerate(last["samples"]):
            lines.append(f"## Prompt {k + 1}")
            if first is not last and k < len(first["samples"]):
                lines += [f"**Before (step {first['step']}):**", "", "```", first["samples"][k], "```", ""]
            lines += [f"**After (step {last['step']}):**", "", "```", after, "```", ""]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def _summary_text(run_dir: Path, s: dict[str, Any]) -> str:
    ev = f", validation loss {s['eval_loss']:.4f}" if s["eval_loss"] is not None else ""
    tl = f", train loss {s['final_train_loss']:.4f}" if s["final_train_loss"] is not None else ""
    return (f"done: step {s['step']}{tl}{ev}; {s['params'] / 1e6:.2f}M params\n"
            f"run directory: {run_dir} (checkpoints/, metrics.jsonl, loss.png, samples.jsonl, tensorboard/)")

