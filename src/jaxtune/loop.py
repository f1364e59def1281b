"""``train(cfg)``: the training loop, top to bottom.

run directory (claimed: one run at a time) → `_setup` (checkpoints → mesh → data → model, objective, steps → frozen
weights → restore or init → the components, in a `Run` record) → `_loop` → `_finish` (the final report). Each component
owns its own schedule and files: `Checkpointer` (``checkpoint.every``, identity check), `StepLog` (metrics, the NaN
policy's verdict, on which the loop stops), `Evaluator` (``eval.every``: held-out scores, samples, report.md),
`Preemption` (SIGTERM, Ctrl-C).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from jaxtune import runtime, sharding
from jaxtune.backends import Backend, backend_of
from jaxtune.companions import load_rollout, loaded_companion
from jaxtune.config import Config, ConfigError, dump_config
from jaxtune.data import TrainingData, load_tokenizer, make_training_data
from jaxtune.evaluator import Evaluator
from jaxtune.job import distributed
from jaxtune.job.checkpoint import Checkpointer
from jaxtune.job.profile import Profiler
from jaxtune.job.run_dir import RunDirError, claim, make_run_dir
from jaxtune.models.fits import check_fits
from jaxtune.models.hf import checkpoint_tokenizer
from jaxtune.models.quantize import is_quantized, logical_size
from jaxtune.rollout.lagged import Lagged
from jaxtune.rollout.rollout import Rollout, clipped_rows
from jaxtune.train.ahead import Ahead, placed
from jaxtune.train.metrics import (
    Laps,
    NonFinite,
    NonFiniteLossError,
    ParameterCount,
    StepLog,
    prefetch_plotting,
    write_loss_plot,
    write_summary,
)
from jaxtune.train.reference import Frozen, Precomputed, ReferenceSync, precompute_reference, reference_sync
from jaxtune.train.shapes import BatchShapes, Shape, train_key
from jaxtune.train.state import ModelSpec, TrainState
from jaxtune.train.step import Steps, eval_key, run_steps

__all__ = ["NonFiniteLossError", "TrainResult", "train"]


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss, for the steps run here
    eval_loss: float | None = None
    step_compiles: int = 0
    # the batch lengths the train step met, one program each (rows in regions: (prompt slots, completion slots))
    step_lengths: list[int | tuple[int, int]] = field(default_factory=list)
    sampler_compiles: int = 0  # GRPO: programs the rollout sampler compiled (one per prompt and cache bucket)
    nan_skipped: int = 0
    preempted: bool = False
    samples: list[str] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "loss", "samples"} per evaluation


def train(cfg: Config) -> TrainResult:
    """Train (or resume) the run described by ``cfg``; re-running the same config resumes it.

    The run directory is locked while it trains (a second run on it is refused), and a write into it that fails
    (read-only, disk full) is one `WriteError` line."""
    multi_host = distributed.initialize(cfg.distributed)  # before anything touches a device
    if multi_host:
        distributed.check_same_config(cfg.to_dict())
    backend = backend_of(cfg)
    if getattr(cfg.model, "attention", None) == "splash" and jax.devices()[0].platform != "tpu":
        raise ConfigError(f"model.attention=splash is JAX's TPU attention kernel, and this run's devices are "
                          f"{jax.devices()[0].platform}: use model.attention=auto (XLA's, the same math) here")
    run_dir = cfg.run_path
    with distributed.together(multi_host, (RunDirError,)):
        make_run_dir(run_dir)
    with claim(run_dir, multi_host):
        return _train(cfg, backend, run_dir, multi_host)


def rows_per_device(cfg: Config, ways: int) -> Config:
    """GRPO groups laid out one row per prompt (``data.share_prompts``) need a multiple of the ``ways`` data-parallel
    devices of prompts a step: where the key is unset the run takes a row per completion instead, where it is set a
    `ConfigError` says what to change."""
    if not (cfg.data.kind.generates and cfg.data.shares_prompts and cfg.train.batch_size % ways):
        return cfg
    if cfg.data.share_prompts is None:
        return cfg.model_copy(update={"data": cfg.data.model_copy(update={"share_prompts": False})})
    raise ConfigError(f"objective.prompts_per_step={cfg.train.batch_size}: with data.share_prompts each prompt's "
                      f"group is one row, and {ways} data-parallel devices need a multiple of {ways} rows; set "
                      f"objective.prompts_per_step to a multiple of {ways}, or data.share_prompts=false (a row per "
                      "completion)")


@dataclass
class Run:
    """A run set up (`_setup`): what the loop reads, steps and reports to."""

    cfg: Config
    run_dir: Path
    mesh: Any
    data: TrainingData
    spec: ModelSpec
    steps: Steps
    rollout: Rollout | None  # GRPO: samples each batch's completions
    lagged: Lagged | None  # objective.max_staleness: the rollouts of the next steps, sampled ahead
    behind: tuple[list[int], list[Any]]  # those a restored checkpoint had sampled ahead: steps, trained params
    sync: ReferenceSync | None  # TR-DPO: the reference copy mixed with the policy every so many updates
    frozen: Frozen  # weights the steps read and never train (a LoRA base, the companion's), as restored
    state: TrainState  # restored, or initialised
    start: int  # the step restored (0: from scratch)
    params: ParameterCount  # all, and those trained
    ckpt: Checkpointer
    log: StepLog
    evaluator: Evaluator
    shapes: BatchShapes  # each batch cut to its length bucket, one program each
    profiler: Profiler
    laps: Laps  # where the wall time goes (summary.json "seconds")


def _train(cfg: Config, backend: Backend, run_dir: Path, multi_host: bool) -> TrainResult:
    ahead = Ahead() if cfg.train.compile_ahead and backend.traces_in_threads else None  # programs compiled ahead
    try:
        run = _setup(cfg, backend, run_dir, multi_host, ahead)
    except BaseException:
        if ahead is not None:
            ahead.close(wait=False)  # nothing more is compiled for a run that did not start
        raise
    run.laps.lap("setup")
    try:
        with distributed.Preemption(multi_host) as preemption, sharding.use_mesh(run.mesh), \
                run.ckpt.reporting_failures(), run.profiler:
            state, step = _loop(run, preemption)
        return _finish(run, state, step, preemption.requested)
    finally:
        if ahead is not None:
            ahead.close(wait=False)  # done already, unless the loop stopped on an error
        if run.rollout is not None:
            run.rollout.close()  # the tools' worker, if any


def _setup(cfg: Config, backend: Backend, run_dir: Path, multi_host: bool, ahead: Ahead | None = None) -> Run:
    """Checkpoints → mesh → data → model, objective, steps (``ahead``: their first programs compiled on its threads
    from then on) → frozen weights → restore or init → the components that report."""
    laps = Laps()
    _use_compile_cache(cfg)
    proc = jax.process_index()

    ckpt, start, cfg = _resumed(cfg, run_dir, proc)

    # Mesh and data.
    mesh = sharding.mesh_of(cfg.mesh)
    cfg = rows_per_device(cfg, mesh.shape["data"] * mesh.shape["fsdp"])
    with distributed.together(multi_host):  # a file missing on one host stops every host, naming it
        tokenizer = load_tokenizer(checkpoint_tokenizer(cfg.tokenizer), cfg.data)
        data = make_training_data(cfg.data, tokenizer, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                                  eval_batches=cfg.eval.batches, process_index=proc,
                                  process_count=jax.process_count(), max_prompt_tokens=cfg.max_prompt_tokens,
                                  margins=cfg.objective.spec.margins)
    if proc == 0:
        tokenizer.save(run_dir / "tokenizer")  # after the data: fine-tuning data may set its chat template

    # Model, optimizer and objective: the train and eval steps, jitted once (state donated, shardings explicit).
    spec = backend.build(cfg, tokenizer.vocab_size, mesh)
    check_fits(spec.model_cfg.vocab_size, spec.model_cfg.max_seq_len, seq_len=cfg.data.seq_len)
    runtime.release_malloc(4 * spec.model_cfg.num_params())  # a large model: give freed memory back (runtime.py)
    steps = run_steps(spec, cfg, loaded_companion(cfg, mesh, spec.model_cfg.vocab_size, tokenizer))
    rollout, own = _rollout(cfg, mesh, spec, tokenizer, data)
    sync = reference_sync(cfg.objective, steps.companion)
    params, notes = _model_notes(cfg, spec, rollout)

    # The first programs compile on worker threads from here on, while the weights are made and read.
    shapes = BatchShapes.of(cfg, context=mesh.shape.get("context", 1))
    notes += shapes.context_notes()
    ahead = ahead.on(mesh) if ahead is not None and start < cfg.train.steps else None
    early = ahead is not None and not start and not isinstance(steps.companion, Precomputed)  # the data as stepped
    if early:
        notes.append(_compile_ahead(ahead, cfg, steps, shapes, data, rollout is None, start))

    # Restore or init, then the frozen weights (a synced reference is the restored step's), then the data position.
    if start:
        start, state, data_state = ckpt.restore(start, spec.abstract)  # an older step if this one is damaged
    else:
        state, data_state = spec.init(cfg.train.seed), None
    synced = ckpt.restore_reference(start, sync.abstract) if start and sync is not None else None
    frozen, data, reference_notes = _frozen(cfg, run_dir, spec, steps, data, synced)
    if data_state is not None:
        data.train_iter.set_state(data_state)
    if ahead is not None and not early:  # the batches as stepped are known only now
        notes.append(_compile_ahead(ahead, cfg, steps, shapes, data, rollout is None, start))
    steps.ahead = ahead

    log, evaluator, profiler = _reporting(cfg, run_dir, steps, tokenizer, data, rollout, shapes, start,
                                          ckpt.notes(start, cfg.train.steps) + data.report + notes + reference_notes)
    lagged, behind = _lagged(cfg, ckpt, spec, steps, data, rollout, start, own)
    return Run(cfg=cfg, run_dir=run_dir, mesh=mesh, data=data, spec=spec, steps=steps, rollout=rollout, sync=sync,
               frozen=frozen, state=state, start=start, params=params, ckpt=ckpt, log=log, evaluator=evaluator,
               shapes=shapes, profiler=profiler, laps=laps, lagged=lagged, behind=behind)


def _resumed(cfg: Config, run_dir: Path, proc: int) -> tuple[Checkpointer, int, Config]:
    """The run's checkpoints, the step to resume from (0: none) and the config as run, saved in ``run_dir``.
    Checkpoints first: resuming with a different model/data/seed is refused before any work is done. A run saved
    before ``train.draw`` existed sampled by Gumbel draws: resumed with the key unset, it keeps them, so that its
    rollouts are those it would have sampled. A run keeps the ``model.formulation`` and ``optim.formulation`` it was
    saved with unless the config sets them (0 when saved before they existed), so that its steps continue bitwise
    whatever the defaults have become since."""
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    start = ckpt.resume_step(cfg.to_dict())
    saved = ckpt.read_config(start) if start else {}
    if start and "draw" not in cfg.train.model_fields_set and "draw" not in saved.get("train", {}):
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"draw": "gumbel"})})
    for section in ("model", "optim") if start else ():
        part = getattr(cfg, section)
        if "formulation" in type(part).model_fields and "formulation" not in part.model_fields_set:
            kept = saved.get(section, {}).get("formulation", 0)
            cfg = cfg.model_copy(update={section: part.model_copy(update={"formulation": kept})})
    if proc == 0:
        dump_config(cfg, run_dir / "config.yaml")
    return ckpt, start, cfg


def _rollout(cfg: Config, mesh: Any, spec: ModelSpec, tokenizer: Any,
             data: TrainingData) -> tuple[Rollout | None, Any]:
    """GRPO's rollouts (prompt data), their reward models on the sampler's devices, and those devices' own mesh
    (``mesh.rollout``; else None: the sampler shares ``mesh``)."""
    own = sharding.sampler_mesh(cfg.mesh.rollout)
    return (None if data.prompts is None else load_rollout(cfg, own or mesh, spec.generator(), tokenizer)), own


def _lagged(cfg: Config, ckpt: Checkpointer, spec: ModelSpec, steps: Steps, data: TrainingData,
            rollout: Rollout | None, start: int, own: Any) -> tuple[Lagged | None, tuple[list[int], list[Any]]]:
    """``objective.max_staleness``'s rollouts sampled ahead (`jaxtune.rollout.lagged`; on ``own``, the sampler's mesh,
    where it has one), and those the restored step ``start`` had sampled ahead (their steps and trained params, to
    sample them again)."""
    k = getattr(cfg.objective, "max_staleness", 0)
    if not k or rollout is None:
        return None, ([], [])
    behind = ckpt.restore_behind(start, spec.abstract.params) if start else ([], [])
    return Lagged(k, cfg.train.steps, rollout, steps.weights, data, own), behind


# The persistent compilation cache's bound. With a bound, JAX also takes a file lock around each entry's read and
# write; without one it writes entries in place, and a process (or a compile-ahead thread) reading an entry another
# is still writing hands XLA a truncated executable (an XLA:CPU segfault in the suite, 2026-12-08).
COMPILE_CACHE_BYTES = 8 << 30


def _use_compile_cache(cfg: Config) -> None:
    if cfg.train.compile_cache_dir:  # JAX keys entries by program, options, flags, device kind and versions
        jax.config.update("jax_compilation_cache_dir", str(Path(cfg.train.compile_cache_dir).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)  # 1 s would skip eval and sampler
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)


def _reporting(cfg: Config, run_dir: Path, steps: Steps, tokenizer: Any, data: TrainingData, rollout: Rollout | None,
               shapes: BatchShapes, start: int, lines: list[str]) -> tuple[StepLog, Evaluator, Profiler]:
    """The components that report (the step log, the evaluator, the profiler), and the start of training's
    ``lines`` said."""
    log = StepLog(run_dir, cfg, start, steps.spec.model_cfg)
    eval_batches = [shapes.fit(b)[0] for b in data.eval_batches]  # each held-out batch at its own bucket
    evaluator = Evaluator(cfg, steps, tokenizer, eval_batches, run_dir, log, data.eval_examples, rollout,
                          data.prompts.val if data.prompts is not None else None, start=start)
    for line in filter(None, lines):
        log.message(line)
    profiler = Profiler(cfg.train.profile_steps, run_dir, start, log.message)
    if jax.process_index() == 0:
        prefetch_plotting()  # loss.png at the end
    return log, evaluator, profiler


def _model_notes(cfg: Config, spec: ModelSpec, rollout: Rollout | None) -> tuple[ParameterCount, list[str]]:
    """The model's parameters (all, and those trained), and what the start of training says about the model (and
    the rollout)."""
    trained, frozen_count = logical_size(spec.abstract.params), logical_size(spec.frozen_abstract)
    params = ParameterCount(trained + frozen_count, trained)
    quantized = ", its quantized kernels counted as the weights they stand for" if any(
        map(is_quantized, jax.tree.leaves(spec.frozen_abstract, is_leaf=is_quantized))) else ""
    notes = [f"model: {params}" + (f" ({trained / params.total:.2%}: the LoRA adapters; the base is frozen{quantized})"
                                   if frozen_count else "")]
    if rollout is not None:
        o = cfg.objective
        notes.append(f"{o.name}: {o.prompts_per_step} prompts x {o.num_generations} completions = "
                     f"{o.prompts_per_step * o.num_generations} completions a step (objective.prompts_per_step "
                     "x num_generations)")
    return params, notes


def _frozen(cfg: Config, run_dir: Path, spec: ModelSpec, steps: Steps, data: TrainingData,
            synced: Any = None) -> tuple[Frozen, TrainingData, list[str]]:
    """The frozen weights (a LoRA base, a reference copy, a teacher: not in the checkpoint, read again; ``synced``: a
    reference copy the checkpoint holds, mixed with the policy), and the data with the reference log-probs computed
    once put into its batches (before the data position is restored)."""
    model = spec.load_frozen(cfg.train.seed)
    notes = []
    if isinstance(steps.companion, Precomputed):  # the reference's log-probs
        logps, note = precompute_reference(run_dir, spec, cfg, data, model)
        data = data.with_reference(logps)
        notes.append(note)
    frozen = steps.frozen(model, cfg.train.seed) if synced is None else Frozen(tuple(model), synced)
    return frozen, data, notes


def _loop(run: Run, preemption: distributed.Preemption) -> tuple[TrainState, int]:
    """The steps from the restored one to ``train.steps`` (or the step a preemption stops at), then the last save
    and evaluation; each component keeps its own schedule (``eval.every``, ``checkpoint.every``, ``logging.every``)."""
    cfg, log, laps, evaluator, ckpt, profiler = run.cfg, run.log, run.laps, run.evaluator, run.ckpt, run.profiler
    total, state, step, frozen = cfg.train.steps, run.state, run.start, run.frozen
    heap = runtime.HeapWatch.start(run.mesh.devices.flat[0].platform)  # a CPU step reuses its pages (runtime.py)
    if step == 0 and evaluator.active:
        if not cfg.logging.progress:  # else its progress bar says so
            log.message("step 0: evaluating the starting model (the baseline report.md compares against) ...")
        evaluator.run(0, state.params, frozen, bar=cfg.logging.progress)
        laps.lap("eval")
    filled = run.lagged.fill(step, state.params, frozen, run.behind) if run.lagged is not None else ""
    if filled:
        log.message(filled)
    while step < total:
        profiler.before(step + 1)  # the trace holds the whole step: its batch, GRPO's sampling, the update
        batch, shape, sampled = _next_batch(run, state, frozen, step)
        trained = functools.partial(_train_step, run, state, frozen, batch, shape, step + 1)
        state, metrics = trained() if run.lagged is None else run.lagged.advance(step + 1, state.params, frozen,
                                                                                   trained)
        if step == run.start:
            laps.lap("compile")  # the first dispatch compiled the step (or loaded it from the cache)
        step += 1
        profiler.after(step, state)
        _check(run, log.push(step, {**metrics, **sampled}, shape))
        if heap is not None:
            _check(run, _one_at_a_time(heap, log, state))
        if run.sync is not None and run.sync.due(step):  # before this step's evaluation and save, as TRL's
            frozen = run.sync(frozen, state.params)
            log.message(run.sync.note(step))
        if evaluator.due(step):
            _evaluate(run, step, state, frozen)
        stop = preemption.reached(step)
        if ckpt.due(step) or step == total or stop:
            _save(run, step, state, frozen)
        if stop:
            ckpt.wait()  # saved before saying so (a second Ctrl-C meanwhile still aborts at once)
            log.message(f"{preemption.signal}: saved step {step}, exiting; re-run the same command to resume")
            break
    _check(run, log.drain())
    laps.lap("steps")
    if run.steps.ahead is not None:
        run.steps.ahead.close()  # what the steps met was waited for; what they did not is dropped
        run.steps.ahead = None
    if step == total:
        if ckpt.latest_step() != total:
            _save(run, total, state, frozen)
        evaluator.run(total, state.params, frozen)
        laps.lap("eval")
    return state, step


def _compile_ahead(ahead: Ahead, cfg: Config, steps: Steps, shapes: BatchShapes, data: TrainingData,
                   batches_known: bool, start: int) -> str:
    """Submits the programs the run meets first to ``ahead`` (`jaxtune.train.ahead`), on the shapes and shardings of
    the state and the frozen weights to come: the evaluation's, one per held-out bucket, then the train step's for
    each bucket of the next ``train.compile_ahead`` batches that steps after ``start`` will read (read ahead, then
    the data position put back).
    ``batches_known`` is False for a rollout's batches: they are made by sampling, so the train step is compiled
    ahead for one guess, the next prompt batch with every completion at ``max_completion_length`` (`clipped_rows`),
    and any other shape when met. Returns the line that says what compiles."""
    spec = steps.spec
    state = placed(spec.abstract, spec.shardings)
    frozen = placed(steps.abstract_frozen(), steps.frozen_shardings())
    programs, n = [], min(cfg.train.compile_ahead, cfg.train.steps - start)  # (key, jitted, batch), as needed
    if cfg.data.kind.held_out != "answers":
        programs += [(eval_key(b), steps.eval, b) for b in (shapes.fit(b)[0] for b in data.eval_batches)]
    it = data.train_iter
    position = it.get_state()
    for _ in range(n if batches_known else min(n, 1)):
        batch = next(it) if batches_known else clipped_rows(cfg, data.prompts.train, next(it))
        batch, shape = shapes.fit(batch)
        programs.append((train_key(shape), steps.train, batch))
    it.set_state(position)
    first = next((i for i, p in enumerate(programs) if p[1] is steps.train), None)
    if first is not None:  # the first step's program first (the longest to compile), the other buckets' after it
        programs.insert(0, programs.pop(first))
    for key, jitted, batch in programs:
        trained = state.params if jitted is steps.eval else state
        ahead.submit(key, jitted, trained, sharding.global_batch(spec.mesh, batch), frozen,
                     later=jitted is steps.train and key != programs[0][0])
    evals = len({key for key, jitted, _ in programs if jitted is steps.eval})
    trains = len(ahead.pending) + len(ahead.deferred) - evals
    what = [f"{evals} held-out evaluation program{'s' * (evals > 1)}"] if evals else []
    if trains and batches_known:
        what.append(f"{trains} train-step program{'s' * (trains > 1)} (the length buckets of the next {n} batches)")
    elif trains:
        what.append("1 train-step program (the next prompts' completions cut at objective.max_completion_length)")
    return f"compiling ahead on {ahead.workers} threads (train.compile_ahead): {' and '.join(what)}" if what else ""


def _next_batch(run: Run, state: TrainState, frozen: Frozen,
                step: int) -> tuple[dict[str, Any], Shape, dict[str, float]]:
    """The batch of step ``step + 1`` cut to its length bucket (fine-tuning rows, pairs, completions), its shape,
    and GRPO's rollout metrics: its completions sampled by the policy as it is now (or, sampled ahead, as it was:
    `jaxtune.rollout.lagged`)."""
    batch, sampled = run.lagged.take(step + 1) if run.lagged is not None else (next(run.data.train_iter), {})
    if run.rollout is not None and run.lagged is None:
        batch, sampled = run.rollout.batch(run.steps.weights(state.params, frozen), run.data.prompts.train,
                                           batch, step, more=lambda: next(run.data.train_iter))
    batch, shape = run.shapes.fit(batch)
    return batch, shape, sampled


def _train_step(run: Run, state: TrainState, frozen: Frozen, batch: dict[str, Any], shape: Shape,
                step: int) -> tuple[TrainState, dict[str, Any]]:
    """Train step ``step`` on the host ``batch`` (a length bucket's first batch compiles its program, said)."""
    return run.shapes.step(lambda: run.steps.train(state, sharding.global_batch(run.mesh, batch), frozen), shape,
                           step, run.log.message, run.steps.ahead)


def _one_at_a_time(heap: runtime.HeapWatch, log: StepLog, state: TrainState) -> NonFinite | None:
    """On a CPU run's kept heap, wait for the step, so that the next one reuses its buffer (`runtime.HeapWatch`), and
    read its metrics now (its row is written at once, not after the next step)."""
    jax.block_until_ready(state)
    heap.after_step()
    return log.drain()


def _check(run: Run, stop: NonFinite | None) -> None:
    """Stops training where the NaN policy says so (`StepLog`), once the checkpoint being written is complete, with
    the last good one named."""
    if stop is not None:
        run.ckpt.wait()
        raise stop.error(run.ckpt.latest_step())


def _evaluate(run: Run, step: int, state: TrainState, frozen: Frozen) -> None:
    _check(run, run.log.drain())  # the steps' time ends at a host sync
    run.laps.lap("steps")
    run.evaluator.run(step, state.params, frozen)
    run.laps.lap("eval")


def _save(run: Run, step: int, state: TrainState, frozen: Frozen) -> None:
    _check(run, run.log.drain())  # never save a state whose loss has not been checked
    run.laps.lap("steps")
    synced = frozen.companion if run.sync is not None else None  # a reference that training changes is state
    lagged = run.lagged
    position = lagged.position() if lagged is not None else run.data.train_iter.get_state()
    run.ckpt.save(step, state, position, run.cfg.to_dict(), reference=synced,
                  behind=lagged.behind() if lagged is not None else None)
    run.laps.lap("save")


def _finish(run: Run, state: TrainState, step: int, preempted: bool) -> TrainResult:
    """Close the components; loss.png, report.md and summary.json (process 0); the result."""
    whole = run.shapes.whole_note()
    if whole is not None:
        run.log.message(whole)
    run.ckpt.close()
    run.data.close()
    run.log.close()
    log, evaluator, laps = run.log, run.evaluator, run.laps
    result = TrainResult(run_dir=run.run_dir, step=step, losses=log.losses, eval_loss=evaluator.last_loss,
                         step_compiles=run.steps.compiles, step_lengths=sorted(run.shapes.lengths),
                         sampler_compiles=run.rollout.generator.compiles if run.rollout is not None else 0,
                         nan_skipped=log.nan_skipped, preempted=preempted, samples=evaluator.samples,
                         evals=evaluator.evals)
    if jax.process_index() == 0:
        write_loss_plot(run.run_dir)
        evaluator.write_report()
    laps.lap("finish")
    if jax.process_index() == 0:
        write_summary(run.run_dir, {"step": step, "final_train_loss": log.losses.get(step),
                                    "eval_loss": result.eval_loss, "nan_skipped": log.nan_skipped,
                                    "preempted": preempted, "params": run.params.total,
                                    "trained_params": run.params.trained, "step_compiles": run.steps.compiles,
                                    "step_lengths": result.step_lengths,
                                    **({"context_whole_rows": [run.shapes.whole_rows, run.shapes.rows]}
                                       if run.shapes.context > 1 else {}),
                                    "seconds": {k: round(v, 3) for k, v in laps.seconds.items()}},
                      preempted)
        if not preempted:
            print(laps.line(), flush=True)
    return result
