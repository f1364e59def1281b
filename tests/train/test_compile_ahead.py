"""Programs compiled ahead (issue 49, `jaxtune.train.ahead`): a run compiles the held-out evaluation's programs and the
train step's for the buckets of the next ``train.compile_ahead`` batches on worker threads, and then trains exactly as
a run that compiles each program at its first dispatch: the same losses bit for bit, the same programs (one per
bucket met, none that is not met), each said once, and after a resume the buckets read ahead are those of the
restored data position. A GRPO run, whose batches are sampled, compiles one guess ahead (the next prompts with every
completion at max_completion_length: `jaxtune.rollout.rollout.clipped_rows`); when the first step meets it, it is not
compiled again, and when no step does, it is the one program more and changes nothing else."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
from helpers.tiny_runs import GRPO_REST, arithmetic_prompts_file, run_overrides

from jaxtune import loop
from jaxtune.config import load_config
from jaxtune.loop import train
from jaxtune.rollout import rollout

BASE = ["model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=4",
        "model.n_kv_head=2", "model.d_ff=128", "model.max_seq_len=128", "objective.name=dpo",
        "data.format=preference", "data.sources=[synthetic:arithmetic-preferences]", "data.chat_template=chatml",
        "data.seq_len=128", "data.val_fraction=0.01", "data.length_buckets=8", "tokenizer.kind=bpe",
        "tokenizer.vocab_size=300", "tokenizer.train_bytes=100000",
        "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]", "train.batch_size=2", "checkpoint.every=3",
        "eval.every=3", "eval.batches=2", "eval.exact_match=0", "logging.every=1", "logging.progress=false",
        "logging.tensorboard=false", "train.compile_cache_dir=null"]

AHEAD = r"step (\d+): the train step for batches of (\d+) positions was compiled ahead"
WHEN_MET = r"step (\d+): compiling the train step for batches of (\d+) positions"


def _run(tmp_path, capsys, name, *extra):
    result = train(load_config(None, [*BASE, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / name}",
                                      *extra]))
    said = capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    losses = {(r["kind"], r["step"]): r["loss"] for r in rows}
    return result, said, losses


def _lengths(pattern, said):
    return [(int(step), int(n)) for step, n in re.findall(pattern, said)]


def test_a_run_compiled_ahead_trains_as_one_compiled_when_met(tmp_path, capsys):
    ahead, said_ahead, losses_ahead = _run(tmp_path, capsys, "ahead", "train.steps=6")
    met, said_met, losses_met = _run(tmp_path, capsys, "met", "train.steps=6", "train.compile_ahead=0")
    assert losses_ahead == losses_met  # bit for bit, held-out losses included
    first_met = _lengths(WHEN_MET, said_met)
    assert len(first_met) >= 2, said_met  # the data meets several buckets, so several programs are compiled ahead
    assert _lengths(AHEAD, said_ahead) == first_met and not _lengths(WHEN_MET, said_ahead)
    assert ahead.step_compiles == met.step_compiles == len(first_met)  # none twice, none that was not met
    assert ahead.step_lengths == met.step_lengths

    # a look-ahead of one batch: the first step's program compiled ahead, the rest when met
    short, said, _ = _run(tmp_path, capsys, "short", "train.steps=6", "train.compile_ahead=1")
    assert _lengths(AHEAD, said) == first_met[:1] and _lengths(WHEN_MET, said) == first_met[1:]
    assert short.step_compiles == len(first_met)


def test_a_resumed_run_reads_ahead_from_its_restored_position(tmp_path, capsys):
    _run(tmp_path, capsys, "ahead", "train.steps=3")
    shutil.copytree(tmp_path / "ahead", tmp_path / "met")  # the same run stopped at step 3, resumed both ways
    # one step more: only its batch is read ahead, not the 32 after the restored position
    ahead, said_ahead, losses_ahead = _run(tmp_path, capsys, "ahead", "train.steps=4")
    met, said_met, losses_met = _run(tmp_path, capsys, "met", "train.steps=4", "train.compile_ahead=0")
    assert losses_ahead == losses_met
    first_met = _lengths(WHEN_MET, said_met)
    assert [step for step, _ in first_met] == [4]
    assert _lengths(AHEAD, said_ahead) == first_met and ahead.step_compiles == met.step_compiles == len(first_met)


GRPO_AHEAD = (r"step (\d+): the train step for batches of (\d+) positions \(a prompt's (\d+) slots, then 4 "
              r"completions of (\d+)\) was compiled ahead")
GRPO_MET = r"step (\d+): compiling the train step for batches of (\d+) positions"


def _grpo(tmp_path, capsys, name, *extra):
    make = run_overrides(GRPO_REST, arithmetic_prompts_file(tmp_path), tmp_path, tmp_path / "cache")
    result = train(load_config(None, make("train.steps=3", "eval.every=0", "eval.exact_match=0",
                                          "train.compile_cache_dir=null", *extra, run=name)))
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, capsys.readouterr().out, {(r["kind"], r["step"]): r["loss"] for r in rows}


def test_a_grpo_run_compiles_its_clipped_shape_ahead(tmp_path, capsys):
    """A tiny random model's completions run to the cap (16 tokens), so the guess is step 1's shape: compiled ahead,
    not again, the losses those of a run that compiles it when met."""
    ahead, said_ahead, losses_ahead = _grpo(tmp_path, capsys, "ahead")
    met, said_met, losses_met = _grpo(tmp_path, capsys, "met", "train.compile_ahead=0")
    assert "1 train-step program (the next prompts' completions cut at objective.max_completion_length)" in said_ahead
    assert losses_ahead == losses_met
    found = re.findall(GRPO_AHEAD, said_ahead)
    assert [(step, width) for step, _, _, width in found] == [("1", "16")], said_ahead
    assert [step for step, _ in re.findall(GRPO_MET, said_met)][:1] == ["1"]
    assert ahead.step_compiles == met.step_compiles == len(ahead.step_lengths)


def test_a_grpo_guess_no_step_meets_is_one_program_more(tmp_path, capsys, monkeypatch):
    """A guess of half the completions' width (no step meets it: they run to the cap, 64) compiles one program more and
    changes nothing else: step 1 compiles its own when met, and the losses are a run's without the guess."""
    def half(cfg, source, prompts):  # the rows of completions half max_completion_length long
        group, width = cfg.objective.num_generations, cfg.objective.max_completion_length // 2
        prompt_ids = [source.ids(int(r)) for r in prompts["row"] for _ in range(group)]
        return rollout.layout(cfg, prompt_ids, [[0] * width] * len(prompt_ids), [[0.0] * width] * len(prompt_ids),
                              np.zeros(len(prompt_ids), np.float32))

    # 16 is the least bucket (half of 16 is 16 too)
    longer = ["objective.max_completion_length=64", "data.seq_len=96", "model.max_seq_len=128"]
    met, _, losses_met = _grpo(tmp_path, capsys, "met", "train.compile_ahead=0", *longer)
    monkeypatch.setattr(loop, "clipped_rows", half)
    missed, said, losses = _grpo(tmp_path, capsys, "missed", *longer)
    assert not re.findall(GRPO_AHEAD, said) and [s for s, _ in re.findall(GRPO_MET, said)][:1] == ["1"], said
    assert losses == losses_met
    assert missed.step_lengths == met.step_lengths and missed.step_compiles == met.step_compiles + 1
