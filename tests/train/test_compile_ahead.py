"""Programs compiled ahead (issue 49, `jaxtune.train.ahead`): a run compiles the held-out evaluation's programs and the
train step's for the buckets of the next ``train.compile_ahead`` batches on worker threads, and then trains exactly as
a run that compiles each program at its first dispatch: the same losses bit for bit, the same programs (one per
bucket met, none that is not met), each said once, and after a resume the buckets read ahead are those of the
restored data position."""

from __future__ import annotations

import json
import re
import shutil

from jaxtune.config import load_config
from jaxtune.loop import train

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
