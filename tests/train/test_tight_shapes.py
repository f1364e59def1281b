"""Tight batches in a real run (issue 30): DPO pairs cut to their length bucket train exactly as pairs padded to
data.seq_len (the same losses to float rounding, the same real tokens), compile one train step per bucket met and
say so, and log real tokens and the padded share."""

from __future__ import annotations

import json
import re

import numpy as np

from jaxtune.config import load_config
from jaxtune.loop import train

MODEL = ["model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=4",
         "model.n_kv_head=2", "model.d_ff=128", "model.max_seq_len=128"]


def _run(tmp_path, name, *extra):
    cfg = load_config(None, [
        *MODEL, "objective.name=dpo", "data.format=preference", "data.sources=[synthetic:arithmetic-preferences]",
        "data.chat_template=chatml", "data.seq_len=128", "data.val_fraction=0.01", f"data.cache_dir={tmp_path}/cache",
        "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.train_bytes=100000",
        "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]", "train.steps=4", "train.batch_size=4",
        "checkpoint.every=4", "eval.every=0", "eval.batches=1", "logging.every=1", "logging.progress=false",
        "logging.tensorboard=false", "train.compile_cache_dir=null", f"run_dir={tmp_path / name}", *extra])
    result = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def test_bucketed_pairs_train_as_padded_ones_with_one_program_per_bucket(tmp_path, capsys):
    tight, tight_rows, tight_evals = _run(tmp_path, "tight")
    said = capsys.readouterr().out
    lengths = [int(n) for n in re.findall(r"the train step for batches of (\d+) positions was compiled ahead", said)]
    assert lengths and all(n < 128 for n in lengths) and len(set(lengths)) == len(lengths)
    assert tight.step_compiles == len(lengths)  # one program per bucket met, none again, none not met
    assert "compiling the train step" not in said  # every bucket met was read ahead (train.compile_ahead=32)

    full, full_rows, full_evals = _run(tmp_path, "full", "data.length_buckets=0")
    assert full.step_compiles == 1
    for a, b in zip(tight_rows, full_rows, strict=True):
        assert a["tokens"] == b["tokens"] and a["count"] == b["count"] == 4.0  # real tokens; pairs in the loss
        assert abs(a["step_loss"] - b["step_loss"]) <= 1e-5 * b["step_loss"]
        assert a["pad_fraction"] < 0.35 and 0.55 < b["pad_fraction"]
        assert a["tokens"] == round((1 - b["pad_fraction"]) * 4 * 2 * 128)
    for a, b in zip(tight_evals, full_evals, strict=True):  # held-out batches are cut to their bucket too
        assert np.isclose(a["loss"], b["loss"], rtol=1e-5) and a["rewards/accuracies"] == b["rewards/accuracies"]
