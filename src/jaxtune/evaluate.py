"""A run's held-out evaluation (`evaluate`, ``jaxtune eval``): the loss and perplexity of its latest checkpoint (or
of a HuggingFace model directory) on its own held-out split or on a test file; for GRPO, held-out prompts answered
greedily and scored by the run's reward functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.companions import load_rollout
from jaxtune.config import REFERENCE_HELD_OUT, ConfigError
from jaxtune.data import make_sequence_batches, make_training_data, test_sequences
from jaxtune.job.checkpoint import Checkpointer
from jaxtune.models.fits import check_fits
from jaxtune.run import LoadedRun, load_run
from jaxtune.train.metrics import perplexity
from jaxtune.train.objectives import make_objective
from jaxtune.train.reference import Frozen, step_reference
from jaxtune.train.shapes import BatchShapes
from jaxtune.train.step import Steps, jit_steps


def evaluate(target: str | Path, overrides: list[str] | tuple[str, ...] = (), batches: int | None = None,
             data: str | None = None, reference: str | Path | None = None) -> dict[str, Any]:
    """Held-out loss and perplexity of a run's latest checkpoint (or a HuggingFace model directory).

    Without ``data``: the run's own held-out split (``eval.batches`` batches). With ``data`` (a file, glob or
    ``hf:`` dataset in the run's ``data.format``): every sequence of it, loss on the tokens the run trains on
    (the assistant's, for chat data). An objective with a reference model (DPO, KTO) compares a run with its own
    reference (its starting weights, as mixed by that checkpoint with ``objective.sync_ref_model``, or its base
    with the adapters off); a model directory has none, so ``reference`` (a model directory of the same
    architecture, e.g. the model it was trained from) is required there, and replaces a full fine-tuning run's own."""
    run = load_run(target, overrides)
    cfg, tok, spec = run.cfg, run.tokenizer, run.spec
    ref_copy = _reference_weights(run, target, reference)
    check_fits(spec.model_cfg.vocab_size, spec.model_cfg.max_seq_len, seq_len=cfg.data.seq_len)
    split = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    size = cfg.train.batch_size
    extra: dict[str, Any] = {}
    if cfg.data.kind.held_out == "answers":  # generated completions: nothing fixed to score, answers to check
        return _evaluate_prompts(run, data)
    if data is None:
        held_out = make_training_data(cfg.data, tok, batch_size=size, seed=cfg.train.seed,
                                      eval_batches=batches or cfg.eval.batches, margins=cfg.objective.spec.margins,
                                      **split)
        eval_batches = held_out.eval_batches
        if not eval_batches:
            raise ConfigError("data.val_fraction is 0 (and no data.val_sources): there is nothing held out to "
                              "evaluate on; pass a test file (jaxtune eval RUN --data FILE)")
    else:
        source, extra = test_sequences(cfg.data, tok, data, cfg.objective.spec.margins)
        eval_batches = make_sequence_batches(source, batch_size=size, num_batches=batches or len(source), **split)
    # A reference model is held here even where training precomputed its log-probs: --data pairs have none stored.
    reference = step_reference(spec, cfg.objective, cfg.train.loss_chunk)
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train, reference)
    frozen = Frozen(run.frozen, ref_copy[0]) if ref_copy else _own_reference(run, steps)
    shapes = BatchShapes.of(cfg)
    eval_batches = [shapes.fit(b)[0] for b in eval_batches]  # each at its length bucket
    with sharding.use_mesh(spec.mesh):
        result = steps.evaluate(run.params, frozen, eval_batches)
    kind = cfg.data.kind
    # A perplexity is exp of a per-token language-model loss; a preference loss has none.
    ppl = {"perplexity": perplexity(result.loss)} if kind.held_out == "loss" else {}
    return {"step": run.step, "loss": result.loss, **ppl, kind.unit: result.count, **result.metrics, **extra}


def _own_reference(run: LoadedRun, steps: Steps) -> Frozen:
    """The steps' frozen weights with the run's own reference: as it started, or where training mixed it with the
    policy (``objective.sync_ref_model``), as the evaluated checkpoint holds it."""
    cfg = run.cfg
    if not (cfg.objective.syncs_reference and run.step):
        return steps.frozen(run.frozen, cfg.train.seed)
    ckpt = Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint)
    try:
        return Frozen(run.frozen, ckpt.restore_reference(run.step, steps.companion.abstract))
    finally:
        ckpt.close()


def _reference_weights(run: LoadedRun, target: str | Path, reference: str | Path | None) -> tuple:
    """(the reference model's params,) from ``reference``, or () to use the run's own; refuses a model directory
    evaluated against itself, and a reference the run cannot take."""
    cfg = run.cfg
    compares = cfg.objective.uses_reference and cfg.data.kind.held_out in REFERENCE_HELD_OUT
    if reference is None:
        if compares and run.is_model:
            raise ConfigError(f"{target} is a model, not a run: objective.name={cfg.objective.name} scores it against "
                              "a reference model, and the only one here is the model itself "
                              f"({cfg.objective.spec.against_itself} whatever it learned); pass --reference MODEL_DIR, "
                              "the model it was trained from")
        return ()
    if not compares:
        raise ConfigError(f"--reference {reference}: objective.name={cfg.objective.name} compares with no reference "
                          "model; drop --reference, or evaluate with objective.name=dpo")
    if run.frozen:
        raise ConfigError(f"--reference {reference}: {target} is a LoRA run, whose reference is its own base with "
                          "the adapters off; drop --reference (or evaluate its merged export with it)")
    if not Path(reference).expanduser().is_dir():
        raise ConfigError(f"--reference {reference}: no such model directory")
    ref_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"from_hf": str(reference)})})
    ref_spec = make_state_spec(ref_cfg, run.tokenizer.vocab_size, run.spec.mesh)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)
    try:
        same = shapes(ref_spec.abstract.params) == shapes(run.spec.abstract.params)
    except ValueError:
        same = False
    if not same:
        raise ConfigError(f"--reference {reference}: not the architecture of {target} (its parameters differ in "
                          "names or shapes); the reference must be the same model family and size")
    return (ref_spec.init(cfg.train.seed).params,)


def _evaluate_prompts(run: LoadedRun, data: str | None) -> dict[str, Any]:
    """A GRPO run: held-out prompts (or every prompt of ``data``) answered greedily and scored by the run's reward
    functions; ``eval.exact_match`` of them when set, else all."""
    cfg = run.cfg
    if data is not None:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(
            update={"sources": [data], "val_sources": [data], "val_fraction": 0.0})})
    prompts = make_training_data(cfg.data, run.tokenizer, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                                 eval_batches=1, max_prompt_tokens=cfg.max_prompt_tokens).prompts
    if prompts.val is None or not len(prompts.val):
        raise ConfigError("data.val_fraction is 0 (and no data.val_sources): there are no held-out prompts to answer; "
                          "pass a prompts file (jaxtune eval RUN --data FILE)")
    count = min(cfg.eval.exact_match or len(prompts.val), len(prompts.val))
    rollout = load_rollout(cfg, run.spec.mesh, run.spec.generator(), run.tokenizer)
    try:
        with sharding.use_mesh(run.spec.mesh):
            _, scores = rollout.held_out(run.weights, prompts.val, count, seed=0)
    finally:
        rollout.close()
    return {"step": run.step, "prompts": count, **scores}
