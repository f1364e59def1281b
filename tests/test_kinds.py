"""Each kind is declared once (`jaxtune.config.kinds`) and every room that implements kinds covers exactly the
declared ones; the batch a kind's pipeline makes is the batch its record says the train step takes."""

from __future__ import annotations

import typing
from collections import Counter

import numpy as np
import pytest
from helpers.rows import build_chat_tokenizers, chatml_cfg, fresh

from jaxtune.config import (
    BATCH_KINDS,
    BUILTIN_REWARDS,
    FAMILY_NAMES,
    FORMATS,
    GGUF_TYPES,
    OBJECTIVE_SECTIONS,
    OBJECTIVES,
    PAIRS,
    PROMPTS,
    ROWS,
    UNPAIRED,
    WINDOWS,
    ConfigError,
    DataConfig,
    NativeModelConfig,
    load_config,
    objective_config,
)
from jaxtune.config.kinds import KIND_OF_FORMAT, objectives_for
from jaxtune.data.formats import FORMATS as ROW_FORMATS
from jaxtune.data.pipeline import PIPELINES, make_training_data
from jaxtune.export import EXPORT_FORMATS
from jaxtune.models.gguf_export import GGUF_TYPES as WRITTEN_GGUF_TYPES
from jaxtune.models.registry import FAMILIES
from jaxtune.rollout.rewards import BUILTINS as REWARD_IMPLEMENTATIONS
from jaxtune.rollout.rollout import shared_rows, training_rows
from jaxtune.train.objectives import OBJECTIVES as IMPLEMENTED
from jaxtune.train.objectives import make_objective
from jaxtune.train.objectives.grpo import LOSS_TYPES as GRPO_LOSS_TYPES


def test_every_kind_has_its_implementation_and_no_more():
    assert set(PIPELINES) == set(BATCH_KINDS.values())
    assert set(IMPLEMENTED) == set(OBJECTIVES)
    assert set(FAMILIES) == set(FAMILY_NAMES)
    # Row formats are parsed by data/formats.py; windows are read as text or token ids.
    assert set(ROW_FORMATS) == {f for k in (ROWS, PAIRS, UNPAIRED, PROMPTS) for f in k.formats}
    assert set(WINDOWS.formats) == {"text", "tokens"}
    assert WRITTEN_GGUF_TYPES is GGUF_TYPES
    assert set(EXPORT_FORMATS) == {"hf", "peft", "gguf"}
    assert GRPO_LOSS_TYPES == OBJECTIVES["grpo"].loss_types
    assert set(REWARD_IMPLEMENTATIONS) == set(BUILTIN_REWARDS)


def test_config_literals_come_from_the_records():
    assert typing.get_args(DataConfig.model_fields["format"].annotation) == FORMATS
    assert tuple(OBJECTIVE_SECTIONS) == tuple(OBJECTIVES)
    for name, section in OBJECTIVE_SECTIONS.items():
        assert typing.get_args(section.model_fields["name"].annotation) == (name,) and section.record().name == name
        loss = section.model_fields.get("loss_type")
        assert loss is None or typing.get_args(typing.get_args(loss.annotation)[0] if OBJECTIVES[name].combines
                                               else loss.annotation) == OBJECTIVES[name].loss_types
        assert loss is None or loss.default == OBJECTIVES[name].default_loss_type
    family = typing.get_args(NativeModelConfig.model_fields["family"].annotation)[0]
    assert typing.get_args(family) == FAMILY_NAMES


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_each_objective_builds_from_its_record(name):
    spec = OBJECTIVES[name]
    rewards = {"rewards": [{"name": "exact_number"}]} if any(k.generates for k in spec.kinds) else {}
    cfg = objective_config(name=name, **rewards)
    obj = make_objective(cfg)
    assert obj.name == name and obj.passes == 1
    assert cfg.uses_reference == (spec.companion == "reference" and (spec.companion_when == "always"
                                                                      or cfg.beta_value > 0))
    assert getattr(obj, "uses_reference", cfg.uses_reference) == cfg.uses_reference
    needs = {"exo_pair": {"label_smoothing": 1e-3}, "cispo": {"epsilon_high": 5.0}}  # a loss type's own required key
    for loss_type in spec.loss_types:
        built = make_objective(objective_config(name=name, loss_type=loss_type, **rewards,
                                                **needs.get(loss_type, {})))
        assert (built.loss_types == ((loss_type, 1.0),)) if spec.combines else built.loss_type == loss_type
    every = {t for o in OBJECTIVES.values() for t in o.loss_types}
    for other in sorted(every - set(spec.loss_types)):
        refused = rf"objective.loss_type(={other})? does not apply to objective.name={name}"
        with pytest.raises(ValueError, match=refused):
            objective_config(name=name, loss_type=other, **rewards)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_objective_on_another_kind_of_data_says_which_formats_and_objectives_fit(fmt):
    kind = KIND_OF_FORMAT[fmt]
    for name, spec in OBJECTIVES.items():
        if kind in spec.kinds:
            continue
        extra = ["objective.rewards=[{name: exact_number}]"] if any(k.generates for k in spec.kinds) else []
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"data.format={fmt}", f"objective.name={name}", *extra])
        msg = str(e.value)
        assert f"objective.name={name} trains on" in msg and f"data.format={fmt} makes {kind.name}" in msg
        assert all(o in msg for o in objectives_for(kind))
        assert "{" not in msg  # names the keys, not the whole config


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    return build_chat_tokenizers(tmp_path_factory.mktemp("tokenizers"))


def _shapes(batch) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(np.shape(v)), str(np.asarray(v).dtype)) for k, v in batch.items()}


@pytest.mark.parametrize("kind", [WINDOWS, ROWS, PAIRS], ids=lambda k: k.name)
def test_the_pipeline_makes_the_batch_the_record_declares(kind, tok_dirs, tmp_path):
    """The batch `make_training_data` yields is what `BatchKind.step_arrays` says the step takes (and what the TPU
    plan compiles for): the same keys, shapes and dtypes."""
    source = {WINDOWS: "python-stdlib", ROWS: "synthetic:arithmetic", PAIRS: "synthetic:arithmetic-preferences"}[kind]
    data_cfg = chatml_cfg(kind.formats[0], sources=[source], seq_len=48, max_bytes=200_000,
                          cache_dir=str(tmp_path / "cache"))
    objective = objective_config(name=objectives_for(kind)[0])
    data = make_training_data(data_cfg, fresh(tok_dirs), batch_size=4, seed=0, eval_batches=1)
    try:
        batch = next(data.train_iter)
    finally:
        data.close()
    assert _shapes(batch) == kind.step_arrays(4, 48, objective, data_cfg.shares_prompts)
    assert data_cfg.shares_prompts == (kind is PAIRS)  # pairs share their prompt by default: (4, 96) rows


def test_grpo_rows_are_the_batch_the_prompts_record_declares():
    """GRPO's step batch: the rollout's rows of B x G completions plus the advantages the loop adds."""
    objective = objective_config(name="grpo", num_generations=2, max_completion_length=4,
                                 rewards=[{"name": "exact_number"}])
    completions = [[6, 7], [8], [9, 9, 9], [1]]
    logps = [[-0.5] * len(c) for c in completions]  # the sampler's, per completion token
    rows = training_rows([[1, 2, 3], [4, 5]] * 2, completions, logps, 16)
    batch = {**rows, "advantages": np.zeros(4, np.float32)}
    assert _shapes(batch) == PROMPTS.step_arrays(2, 16, objective)
    # shared prompts: a row per prompt holding its group in regions (12 prompt slots, then 4 per completion), the
    # advantages per prompt and completion
    rows = shared_rows([[1, 2, 3]] * 2 + [[4, 5]] * 2, completions, logps, 2, 16, 4)
    assert rows["inputs"].shape == (2, 12 + 2 * 4) and rows["branch_slots"].shape == (2, 2, 4)
    batch = {**rows, "advantages": np.zeros((2, 2), np.float32)}
    assert _shapes(batch) == PROMPTS.step_arrays(2, 16, objective, shared=True)


def test_a_batch_kinds_data_module_registers_its_row_format(tmp_path):
    """A new batch kind's data module adds its row format with `register_format` (no edit of data/formats.py):
    detected after the built-in keys it does not hold (before the detect-last ones), parsed by its own parser, and
    its own bad-row reasons reported after the built-in ones; a second registration of a name is refused."""
    from jaxtune.data.formats import FORMATS, Format, detect_format, register_format
    from jaxtune.data.row_policy import RowStats
    from jaxtune.data.rows import BadRow

    def parse(record, fields, data_cfg):
        if record[fields["score"]] not in (0, 1, 2, 3, 4, 5):
            raise BadRow("bad_score", "score must be 0 to 5")
        return record

    fmt = Format("scored_test", {"prompt": "prompt", "completion": "completion", "score": "score"}, "score", parse,
                 ("bad_score",), chat=False)
    register_format(fmt)
    try:
        with pytest.raises(ValueError, match="registered twice"):
            register_format(fmt)
        rows = tmp_path / "rows.jsonl"
        rows.write_text('{"prompt": "p", "score": 4}\n')
        assert detect_format(str(rows)) == "scored_test"  # ahead of prompts, whose key the row holds too
        stats = RowStats(dropped=Counter({"bad_score": 2, "missing_field": 1}))
        assert stats.drop_lines("rows") == ["dropped rows: missing_field 1, bad_score 2"]
    finally:
        del FORMATS["scored_test"]


@pytest.mark.parametrize("keys, says", [
    ({"loss_type": ["sigmoid", "sigmoid"]}, r"list each loss type once"),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
     r"loss_weights=\[1.0\] gives 1 weight for 2 loss types \(sigmoid, sft\): give 2"),
    ({"loss_type": "exo_pair"}, r"exo_pair needs objective.label_smoothing > 0"),
    ({"loss_type": ["hinge", "bco_pair"], "label_smoothing": 0.1}, r"label_smoothing applies to loss_type sigmoid"),
    ({"loss_type": ["sigmoid", "dapo"]}, r"objective.loss_type=dapo does not apply to objective.name=dpo"),
])
def test_dpo_loss_type_lists_are_checked(keys, says):
    with pytest.raises(ValueError, match=says):
        objective_config(name="dpo", **keys)
    cfg = objective_config(name="dpo", loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0])
    assert cfg.weighted_loss_types == (("sigmoid", 0.8), ("bco_pair", 0.2), ("sft", 1.0))
    with pytest.raises(ValueError, match=r"objective.name=grpo takes one loss type, not a list"):
        objective_config(name="grpo", loss_type=["dapo", "grpo"], rewards=[{"name": "exact_number"}])
    with pytest.raises(ValueError, match=r"objective.loss_weights does not apply to objective.name=simpo"):
        objective_config(name="simpo", loss_weights=[1.0])


def test_model_flops_count_the_sequences_a_step_trains():
    """`jaxtune info`'s FLOPs per step (and the TPU plan's MFU, from the same count): a DPO pair trains 2 sequences,
    a GRPO prompt num_generations, a KTO row 1 (its KL row only runs forward, without gradient); a GRPO group that
    shares its prompt (the default) is one row in regions: 64 - 16 prompt slots, then 3 completions of 16."""
    from jaxtune.info import info

    tiny = ["model.preset=tiny", "model.vocab_size=512", "data.seq_len=64", "train.batch_size=4"]
    cases = {("objective.name=dpo", "data.format=preference"): 2, ("objective.name=kto", "data.format=unpaired"): 1,
             ("objective.name=grpo", "data.format=prompts", "objective.num_generations=3", "train.batch_size=null",
              "objective.prompts_per_step=4", "objective.max_completion_length=16",
              "objective.rewards=[{name: length}]", "data.share_prompts=false"): 3, (): 1}
    for overrides, sequences in cases.items():
        d = info(load_config(None, [*tiny, *overrides]), devices=1)
        assert d["flops_per_step"] == d["flops_per_token"] * 4 * sequences * 64, overrides
    grpo = [o for o in next(k for k, v in cases.items() if v == 3) if o != "data.share_prompts=false"]
    d = info(load_config(None, [*tiny, *grpo]), devices=1)
    assert d["flops_per_step"] == d["flops_per_token"] * 4 * (64 - 16 + 3 * 16)
