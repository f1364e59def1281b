"""Preference tuning end to end, through `jaxtune.loop.train`: DPO with each kind of reference model (a frozen copy,
LoRA's base with the adapters off, log-probs precomputed once), SimPO and ORPO, on the native and torchax backends.

Each run: the step compiles once; train and eval rows of metrics.jsonl carry TRL's metric names; report.md has the
held-out reward accuracy of every evaluation; a killed LoRA DPO run resumes bitwise. Tiny models, 240 generated
arithmetic pairs (`synthetic:arithmetic-preferences`' first rows), CPU. The losses themselves are checked against TRL
in test_preference_objectives.py.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.rows import write_jsonl
from helpers.run_outputs import metric_rows
from helpers.tiny_config import QUICK
from helpers.tiny_runs import MODEL, assert_kill9_resume_is_bitwise, run_overrides, torchax_lora_config

from jaxtune.cli import main
from jaxtune.config import load_config
from jaxtune.data import load_tokenizer
from jaxtune.data.synthetic import arithmetic_preferences
from jaxtune.loop import train
from jaxtune.train.objectives.preference import REWARD_METRICS
from jaxtune.train.reference import REF_LOGPS_FILE

REST = ["data.format=preference", "data.chat_template=chatml", "data.seq_len=64", "data.val_fraction=0.1",
        "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
        "objective.name=dpo", "optim.lr=1e-2", "optim.warmup_steps=2", "train.batch_size=8", "train.steps=6",
        "eval.every=3", "eval.batches=2", "checkpoint.every=3", "logging.every=1", "logging.progress=false",
        "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl",
                       itertools.islice(arithmetic_preferences(), 240))


@pytest.fixture
def pref(pairs_file, tmp_path, data_cache):
    """pref("objective.name=orpo", ...) -> overrides of a tiny native preference run in this test's tmp dir."""
    return run_overrides(REST, pairs_file, tmp_path, data_cache)


def test_dpo_quickstart_as_the_readme_runs_it(quickstart_sft_model, tmp_path, data_cache, capsys):
    """The README's commands, shortened: the fine-tuning quickstart, its export, then dpo-quickstart from it (a
    frozen copy as the reference). The step compiles once; train and eval rows carry TRL's metric names; held-out
    reward accuracy starts at 0 (policy == reference) and rises clearly; report.md tabulates it."""
    model, run = quickstart_sft_model, tmp_path / "dpo"
    fast = [f"data.cache_dir={data_cache}", *QUICK]
    capsys.readouterr()
    # Shortened: 24 steps from a 30-step SFT model, at 5x the recipe's learning rate.
    assert main(["train", "dpo-quickstart", f"model.from_hf={model}", f"run_dir={run}", "train.steps=24",
                 "optim.lr=1e-4", "eval.every=12", "eval.batches=4", "checkpoint.every=24", "logging.every=4",
                 *fast]) == 0
    out = capsys.readouterr().out
    assert "preference data: 10000 rows ->" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step_compiles"] == len(summary["step_lengths"])
    train_rows, eval_rows = metric_rows(run, "train"), metric_rows(run, "eval")
    assert [r["step"] for r in eval_rows] == [0, 12, 24]
    for row in train_rows + eval_rows:
        assert set(REWARD_METRICS) <= set(row), row
        assert np.isfinite([row[k] for k in REWARD_METRICS]).all()
    first, last = eval_rows[0], eval_rows[-1]
    assert first["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy == reference: every reward is 0
    assert first["rewards/accuracies"] == 0.0 and first["rewards/margins"] == 0.0
    assert last["rewards/accuracies"] >= 0.6 and last["rewards/margins"] > 0
    assert "perplexity" not in last  # a preference loss is not a log-likelihood
    report = (run / "report.md").read_text()
    assert "| step | held-out loss | reward accuracy |" in report
    assert f"| 24 | {last['loss']:.4f} | {last['rewards/accuracies']:.1%} |" in report

    # Evaluated again on a test file: the run against its own reference (the model it started from); its export, a
    # model directory, has no reference of its own: refused in one line unless --reference names one, and with the
    # starting model as --reference it scores what the run does. (Overrides may follow --data.)
    pairs = write_jsonl(tmp_path / "test-pairs.jsonl", itertools.islice(arithmetic_preferences(seed=1), 24))
    assert main(["export", str(run), str(tmp_path / "dpo-model")]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(pairs), f"data.cache_dir={data_cache}"]) == 0
    of_run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    exported = ["eval", str(tmp_path / "dpo-model"), "--data", str(pairs), "objective.name=dpo",
                f"data.cache_dir={data_cache}"]
    assert main(exported) == 2
    err = capsys.readouterr().err
    assert "is a model, not a run" in err and "--reference MODEL_DIR" in err and "Traceback" not in err
    assert main([*exported, "--reference", str(model)]) == 0
    of_export = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert of_run["pairs"] == of_export["pairs"] == 24 and "perplexity" not in of_export
    for k in ("loss", *REWARD_METRICS):  # the export's weights are the run's (float32), the reference the same
        assert of_export[k] == pytest.approx(of_run[k], rel=1e-4, abs=1e-5), k
    assert of_export["rewards/margins"] != 0.0
    assert main([*exported, "--reference", str(tmp_path / "nowhere")]) == 2
    assert "--reference " in capsys.readouterr().err


def test_kto_quickstart_as_its_header_runs_it(quickstart_sft_model, tmp_path, data_cache, capsys):
    """kto-quickstart from the fine-tuning quickstart's export, shortened: the step compiles once per length; every
    row logs KTO's metrics with TRL's names; at step 0 (policy == reference) the loss is exactly 1/2 and the rewards
    0; the held-out rewards of desirable and undesirable rows then move apart (the margin rises), and report.md
    tabulates the margin; `jaxtune eval` of the run reports the same metrics on a test file."""
    from jaxtune.data.synthetic import arithmetic_unpaired

    run = tmp_path / "kto"
    fast = [f"data.cache_dir={data_cache}", *QUICK]
    assert main(["train", "kto-quickstart", f"model.from_hf={quickstart_sft_model}", f"run_dir={run}",
                 "train.steps=24", "optim.lr=1e-4", "eval.every=12", "eval.batches=4", "checkpoint.every=24",
                 "logging.every=4", *fast]) == 0
    out = capsys.readouterr().out
    assert "unpaired preference data: 10000 rows ->" in out and "desirable" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step_compiles"] == len(summary["step_lengths"])
    metrics = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")
    train_rows, eval_rows = metric_rows(run, "train"), metric_rows(run, "eval")
    assert [r["step"] for r in eval_rows] == [0, 12, 24]
    for row in train_rows + eval_rows:
        assert set(metrics) <= set(row) and np.isfinite([row[k] for k in metrics]).all(), row
    first, last = eval_rows[0], eval_rows[-1]
    assert first["loss"] == 0.5 and first["rewards/chosen"] == first["rewards/rejected"] == first["kl"] == 0.0
    assert last["rewards/margins"] > 0.05 and last["rewards/chosen"] > last["rewards/rejected"], last
    assert "perplexity" not in last
    report = (run / "report.md").read_text()
    assert "| step | held-out loss | reward margin |" in report
    assert f"| 24 | {last['loss']:.4f} | {last['rewards/margins']:.3f} |" in report

    rows = write_jsonl(tmp_path / "test-rows.jsonl", itertools.islice(arithmetic_unpaired(seed=1), 24))
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(rows), f"data.cache_dir={data_cache}"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 24 and set(metrics) <= set(result) and "perplexity" not in result


# kto-quickstart from scratch: the tiny Llama, a 300-id BPE, one length (one compile), a few steps
KTO_TINY = ["model.from_hf=null", *MODEL, "data.seq_len=64", "data.length_buckets=0", "tokenizer.kind=bpe",
            "tokenizer.vocab_size=300", "tokenizer.train_bytes=1000000",
            "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]", "optim.lr=1e-2", "optim.warmup_steps=0",
            "train.batch_size=8", "train.steps=2", "eval.every=2", "eval.batches=2", "checkpoint.every=2",
            "logging.every=1", *QUICK]


def test_kto_on_rows_of_one_label_warns_and_reports_no_rewards_of_the_other(tmp_path, data_cache, capsys):
    """Desirable rows only: training starts with a warning per split naming the file and what to do, and trains;
    no row of metrics.jsonl (train or eval), no log line and no cell of report.md gives the undesirable rows' rewards
    or log-probs, or a margin: a mean of no rows is absent, never 0 (nor the margin the desirable reward)."""
    from jaxtune.data.synthetic import arithmetic_unpaired

    liked = write_jsonl(tmp_path / "liked.jsonl",
                        [r for r in itertools.islice(arithmetic_unpaired(), 120) if r["label"]])
    run = tmp_path / "run"
    assert main(["train", "kto-quickstart", *KTO_TINY, f"data.sources=[{liked}]", "data.val_fraction=0.2",
                 f"run_dir={run}", f"data.cache_dir={data_cache}"]) == 0
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if line.startswith(f"warning: {liked}: all ")]
    assert len(warned) == 2, out
    assert "training rows are desirable (label true)" in warned[0] and "data.unpair=true" in warned[0]
    assert "held-out rows are desirable (label true)" in warned[1] and "data.val_sources" in warned[1]
    rows = metric_rows(run, "train") + metric_rows(run, "eval")
    assert len(rows) == 4 and all("rewards/chosen" in r and "logps/chosen" in r for r in rows)
    absent = {"rewards/rejected", "logps/rejected", "rewards/margins"}
    assert not any(absent & set(r) for r in rows), rows
    said = [line for line in out.splitlines() if line.startswith("step ") and "validation loss" in line]
    assert len(said) == 2 and all("undesirable n/a (no rows)" in line and "margin" not in line for line in said)
    assert said[0] == "step 0: validation loss 0.5000, rewards desirable 0.000, undesirable n/a (no rows), kl 0.000"
    report = (run / "report.md").read_text()
    assert "| 0 | 0.5000 | n/a (no rows) |" in report and "| 2 |" in report, report


def test_kto_on_the_shipped_pairs_with_data_unpair(tmp_path, data_cache, capsys):
    """synthetic:arithmetic-preferences with data.unpair trains KTO (each pair two rows). The held-out rows come in
    unpair's order, every chosen half first, yet each held-out batch holds both labels, so every evaluation reports
    both rewards and their margin; `jaxtune eval` of the run reports the margin as training did, and of its export
    (no reference of its own) refuses in one line naming KTO's loss at the reference, not DPO's."""
    from jaxtune.data.synthetic import arithmetic_unpaired

    run = tmp_path / "run"
    assert main(["train", "kto-quickstart", *KTO_TINY, "data.sources=[synthetic:arithmetic-preferences]",
                 "data.unpair=true", f"run_dir={run}", f"data.cache_dir={data_cache}"]) == 0
    assert "unpaired preference data: 20000 rows ->" in capsys.readouterr().out
    evals = metric_rows(run, "eval")
    assert [r["step"] for r in evals] == [0, 2]
    assert all({"rewards/chosen", "rewards/rejected", "rewards/margins"} <= set(r) for r in evals), evals
    assert evals[0]["rewards/margins"] == 0.0 and evals[-1]["rewards/margins"] != 0.0

    assert main(["eval", str(run), f"data.cache_dir={data_cache}"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rewards/margins"] == pytest.approx(evals[-1]["rewards/margins"], rel=1e-4, abs=1e-6)
    assert main(["export", str(run), str(tmp_path / "model")]) == 0
    rows = write_jsonl(tmp_path / "rows.jsonl", itertools.islice(arithmetic_unpaired(seed=1), 8))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "model"), "--data", str(rows), "objective.name=kto",
                 f"data.cache_dir={data_cache}"]) == 2
    err = capsys.readouterr().err
    assert "is a model, not a run" in err and "loss 0.5 per row" in err and "log 2" not in err, err


def test_precomputed_reference_equals_the_live_one_and_is_reused(pref, tmp_path):
    live = train(load_config(None, pref("train.steps=3", "eval.every=0", run="live")))
    cfg = load_config(None, pref("train.steps=3", "eval.every=0", "objective.precompute_ref_logps=true", run="pre"))
    pre = train(cfg)
    assert pre.step_compiles == len(pre.step_lengths)
    for s in live.losses:  # the reference forward jitted alone vs inside the step: equal to float32 rounding
        assert pre.losses[s] == pytest.approx(live.losses[s], rel=1e-5, abs=1e-6)
    stored = np.load(cfg.run_path / REF_LOGPS_FILE)
    assert stored["train"].shape[1] == 2 and np.isfinite(stored["train"]).all() and (stored["train"] < 0).all()
    resumed = train(load_config(None, pref("train.steps=5", "eval.every=0", "objective.precompute_ref_logps=true",
                                           run="pre")))
    assert resumed.step == 5 and resumed.step_compiles == len(resumed.step_lengths)


def test_kto_precomputed_reference_equals_the_live_one(tmp_path, data_cache, capsys):
    """KTO with objective.precompute_ref_logps: each row's and its KL row's reference log-probs computed once before
    training (as DPO's pairs are) give the live reference's losses, KL baselines and held-out rewards; they are
    stored in the run directory, (rows, 2). Its progress and the run log count rows, not pairs."""
    from jaxtune.data.synthetic import arithmetic_unpaired

    rows = write_jsonl(tmp_path / "rows.jsonl", itertools.islice(arithmetic_unpaired(), 160))
    rest = [r for r in REST if not r.startswith(("data.format", "objective.name"))]
    make = run_overrides([*rest, "data.format=unpaired", "objective.name=kto"], rows, tmp_path, data_cache)
    live = train(load_config(None, make("train.steps=3", "eval.every=3", run="live")))
    capsys.readouterr()
    cfg = load_config(None, make("train.steps=3", "eval.every=3", "objective.precompute_ref_logps=true",
                                 "logging.progress=true", run="pre"))
    pre = train(cfg)
    out, err = capsys.readouterr()
    what = "reference log-probs of the train rows (objective.precompute_ref_logps)"
    total = int(re.search(rf"{re.escape(what)}: (\d+) rows\n", err).group(1))
    assert f"{what}: {total} / {total} rows (100%)" in err and "pairs" not in err
    assert re.search(rf"reference log-probs of {total} train, \d+ val rows computed in", out), out
    assert pre.step_compiles == len(pre.step_lengths)
    for s in live.losses:
        assert pre.losses[s] == pytest.approx(live.losses[s], rel=1e-5, abs=1e-6)
    (a, b) = [[r for r in metric_rows(tmp_path / run, "train")] for run in ("live", "pre")]
    assert [r["kl"] for r in a] == pytest.approx([r["kl"] for r in b], rel=1e-5, abs=1e-6)
    (ea,), (eb,) = [[r for r in metric_rows(tmp_path / run, "eval") if r["step"] == 3] for run in ("live", "pre")]
    assert eb["rewards/margins"] == pytest.approx(ea["rewards/margins"], rel=1e-4, abs=1e-6)
    stored = np.load(cfg.run_path / REF_LOGPS_FILE)
    assert stored["train"].ndim == 2 and stored["train"].shape[1] == 2 and (stored["train"] < 0).all()


def test_precomputed_reference_is_read_back_on_resume(pref, capsys):
    """And while it is computed, a progress bar counts the pairs (here without a terminal: plain lines)."""
    over = pref("train.steps=2", "eval.every=0", "objective.precompute_ref_logps=true", "logging.progress=true")
    cfg = load_config(None, over)
    train(cfg)
    out, err = capsys.readouterr()
    assert "computed in" in out
    what = "reference log-probs of the train pairs (objective.precompute_ref_logps)"
    total = int(re.search(rf"{re.escape(what)}: (\d+) pairs\n", err).group(1))
    assert f"{what}: 0 / {total} pairs (0%)" in err and "compiling the reference forward ..." in err
    assert f"{what}: {total} / {total} pairs (100%)" in err and "\r" not in err
    train(load_config(None, [*over, "train.steps=3"]))
    assert f"pairs read from {cfg.run_path / REF_LOGPS_FILE}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["simpo", "orpo"])
def test_reference_free_objectives_train(pref, name):
    cfg = load_config(None, pref(f"objective.name={name}", "train.steps=4", "eval.every=0"))
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths)
    last = metric_rows(cfg.run_path, "eval")[-1]
    assert set(REWARD_METRICS) <= set(last) and np.isfinite(last["loss"])
    assert last["logps/chosen"] < 0  # SimPO and ORPO log the mean log-prob per completion token
    if name == "orpo":
        assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(last)
    assert not (cfg.run_path / REF_LOGPS_FILE).exists()


def test_dpo_lora_kill9_and_resume_is_bitwise(pref, tmp_path):
    """LoRA DPO (reference: the base with the adapters off), killed after step 6 with step 5 committed, resumed:
    the losses of steps 6-8 and the final adapters equal the uninterrupted run's bitwise."""
    lora = ["model.lora.rank=4", "train.steps=8", "eval.every=0", "checkpoint.every=5", "checkpoint.keep=10"]
    assert_kill9_resume_is_bitwise(tmp_path, pref, lora, steps=8, kill_at=6, commit=5)


def test_dpo_lora_run_exports_an_adapter_and_evaluates(pref, pairs_file, tmp_path, capsys):
    cfg = load_config(None, pref("model.lora.rank=4", "train.steps=2", "eval.every=0"))
    train(cfg)
    capsys.readouterr()
    assert main(["eval", str(cfg.run_path)]) == 0
    held_out = json.loads(capsys.readouterr().out)
    assert held_out["rewards/accuracies"] == metric_rows(cfg.run_path, "eval")[-1]["rewards/accuracies"]
    test_file = tmp_path / "test-pairs.jsonl"
    test_file.write_text("".join(pairs_file.read_text().splitlines(keepends=True)[:40]))
    assert main(["eval", str(cfg.run_path), "--data", str(test_file)]) == 0  # every pair of a test file
    every = json.loads(capsys.readouterr().out)
    assert every["pairs"] == 40 and "perplexity" not in every and 0.0 <= every["rewards/accuracies"] <= 1.0
    assert main(["export", str(cfg.run_path), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_torchax_dpo_lora_uses_the_same_objective(pref, tmp_path):
    cfg = torchax_lora_config(pref("model.lora.rank=4", "train.steps=3", "eval.every=0"), tmp_path)
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths)
    last = metric_rows(cfg.run_path, "eval")[-1]
    assert set(REWARD_METRICS) <= set(last)
    assert last["rewards/margins"] != 0.0  # the adapters moved the policy away from the base


MESH_SCRIPT = """
import json, sys
import jax
from jaxtune.config import load_config
from jaxtune.loop import train
assert jax.device_count() == 4, jax.devices()
runs = json.loads(sys.argv[1])
out = {}
for name, overrides in runs.items():
    result = train(load_config(None, overrides))
    out[name] = {"losses": result.losses, "compiles": result.step_compiles, "lengths": result.step_lengths}
print("LOSSES=" + json.dumps(out))
"""


def test_dpo_on_a_mesh_matches_one_device(pref, tmp_path):
    """DPO over 4 simulated CPU devices (data 2 x fsdp 2: the pairs split over data; the weights, their reference
    copy or the LoRA base sharded over fsdp) gives the single-device losses, with each kind of reference."""
    kinds = {"copy": [], "adapters-off": ["model.lora.rank=4"]}
    short = ["train.steps=3", "eval.every=0", "data.val_fraction=0"]  # no held-out split: no eval step to compile
    runs = {k: pref(*short, *extra, "mesh.data=2", "mesh.fsdp=2", run=f"mesh-{k}") for k, extra in kinds.items()}
    first = load_config(None, runs["copy"])
    load_tokenizer(first.tokenizer, first.data)  # trained and cached once, before two processes want it
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.Popen([sys.executable, "-c", MESH_SCRIPT, json.dumps(runs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:  # the single-device runs in this process while the 4-device ones run in theirs
        one = {k: train(load_config(None, pref(*short, *extra, run=f"one-{k}"))) for k, extra in kinds.items()}
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()  # a no-op once it has exited
    assert proc.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.split("LOSSES=")[-1])
    for kind, result in one.items():
        # one program per batch length, and the same lengths as on one device (the bucket is the global batch's)
        assert out[kind]["compiles"] == len(out[kind]["lengths"]) and out[kind]["lengths"] == result.step_lengths
        for step, loss in result.losses.items():
            assert out[kind]["losses"][str(step)] == pytest.approx(loss, rel=1e-5), (kind, step)
