"""A user's mistake reads as one line, `error: ...`, exit 2, and loses nothing: empty and too-long prompts (and
`--truncate left`), `parity` on a damaged model directory, a damaged token-cache sidecar (re-tokenized, as a damaged
token file is), and `export --overwrite` into a directory holding a file of the user's."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.tiny_config import QUICK, TINY

from jaxtune.cli import main
from jaxtune.config import load_config
from jaxtune.config.kinds import PAIRS, PROMPTS, BatchKind, objectives_for
from jaxtune.data import load_tokenizer_dir, stop_ids
from jaxtune.data.tokens import prepare_tokens
from jaxtune.generate import sample
from jaxtune.io import check_out_dir
from jaxtune.loop import train
from jaxtune.run import load_run

CONTEXT = 64  # model.max_seq_len in TINY
LONG_PROMPT = "import os\nimport sys\n" * 30


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache) -> Path:
    """A tiny trained run (2 steps, one checkpoint), shared by the module: nothing here may change it."""
    cfg = load_config(None, TINY + [f"run_dir={tmp_path_factory.mktemp('user-errors') / 'run'}",
                                    f"data.cache_dir={data_cache}", "train.steps=2", "checkpoint.every=2"])
    train(cfg)
    return cfg.run_path


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes): equal snapshots mean nothing was lost or changed."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def error_line(capsys) -> tuple[str, str]:
    """(stdout, the one `error: ...` line ending stderr); no traceback, and the error is that single last line."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.endswith("\n") and captured.err.count("error: ") == 1
    last = captured.err.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: ") and captured.err.endswith(last + "\n")
    return captured.out, last


# --- 4 and 5: prompts -------------------------------------------------------------------------------------------------


def test_empty_prompt_is_one_line(run_dir, capsys):
    before = snapshot(run_dir / "checkpoints")
    assert main(["generate", str(run_dir), "--prompt", ""]) == 2
    out, err = error_line(capsys)
    assert err == "error: generate: prompt 1 is empty (0 tokens); a prompt needs at least one token"
    assert out == ""
    assert main(["generate", str(run_dir), "--prompt", "def", "--prompt", ""]) == 2
    assert error_line(capsys)[1] == "error: generate: prompt 2 is empty (0 tokens); a prompt needs at least one token"
    assert snapshot(run_dir / "checkpoints") == before


def test_prompt_longer_than_the_context_is_one_line_and_not_echoed(run_dir, capsys):
    n = len(load_tokenizer_dir(run_dir / "tokenizer").encode(LONG_PROMPT))
    assert n > CONTEXT
    before = snapshot(run_dir / "checkpoints")
    assert main(["generate", str(run_dir), "--prompt", LONG_PROMPT]) == 2
    out, err = error_line(capsys)
    assert err == (f"error: generate: prompt 1 has {n} tokens; the model's context is {CONTEXT} tokens, prompt and "
                   "new tokens together: shorten it, or pass --truncate left to keep its last tokens")
    assert out == ""  # the prompt is echoed only once it passed its checks
    assert snapshot(run_dir / "checkpoints") == before


def test_truncate_left_keeps_the_last_tokens(run_dir, capsys, caplog):
    """--truncate left continues the prompt's last (context - new tokens) tokens: the same tokens as generating from
    those ids directly; the warning says how many were kept."""
    new = 4
    with caplog.at_level(logging.WARNING, logger="jaxtune.models.sampling"):
        assert main(["generate", str(run_dir), "--prompt", LONG_PROMPT, "--truncate", "left", "--max-new-tokens",
                     str(new), "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    run = load_run(run_dir)
    tok = run.tokenizer
    ids = tok.encode(LONG_PROMPT)
    keep = CONTEXT - new
    assert (f"generate: prompt 1 has {len(ids)} tokens; keeping its last {keep} so that {new} new tokens fit the "
            f"{CONTEXT}-token context") in caplog.text
    gen = run.spec.generator()
    expected = gen(run.weights, [ids[-keep:]], max_new_tokens=new, eos_id=stop_ids(tok)).ids[0]
    assert captured.out == LONG_PROMPT + tok.decode(expected) + "\n"
    assert sample(gen, run.weights, tok, [LONG_PROMPT], chat=False, max_new_tokens=new, truncate="left") == [expected]
    # A prompt that leaves room is not cut.
    short = tok.encode("import os")
    unchanged = gen(run.weights, [short], max_new_tokens=new, eos_id=stop_ids(tok)).ids
    assert sample(gen, run.weights, tok, ["import os"], chat=False, max_new_tokens=new, truncate="left") == unchanged


# --- 6: parity on a damaged model directory ---------------------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf-gpt2"
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(directory)
    return directory


def test_parity_on_a_missing_directory_is_one_line(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["parity", str(missing)]) == 2
    # The wording is models/hf.py's (`resolve_hf_dir`, shared with model.from_hf): here, that it names the path.
    assert re.fullmatch(rf"error: (\S+=)?{re.escape(str(missing))}: [^/]+", error_line(capsys)[1])
    assert not missing.exists()


@pytest.mark.parametrize("damage, message", [
    ("config.json: cut", r"{dir}/config\.json:\d+: invalid JSON \(.+\)"),
    ("config.json: not a model", r"{dir}: transformers cannot load it: Unrecognized model in .+"),
    ("model.safetensors: cut", r"{dir}/model\.safetensors: truncated \(tensor \S+ ends past the end of the file\)"),
    ("model.safetensors: garbage",
     r"{dir}/model\.safetensors: not a safetensors file \(bad header length\); re-download it"),
    ("model.safetensors: removed", r"{dir}: no \.safetensors weights"),
])
def test_parity_on_a_damaged_directory_is_one_line(hf_dir, capsys, damage, message):
    """The check train and eval make (config.json, safetensors named and complete) runs before transformers."""
    name, _, how = damage.partition(": ")
    file = hf_dir / name
    if how == "cut":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif how == "not a model":
        file.write_text("{}\n")
    elif how == "garbage":
        file.write_bytes(b"\xff" * 64)
    else:
        file.unlink()
    before = snapshot(hf_dir)
    assert main(["parity", str(hf_dir), "--new-tokens", "0"]) == 2
    err = error_line(capsys)[1]
    assert re.fullmatch("error: " + message.format(dir=re.escape(str(hf_dir))), err), err
    assert snapshot(hf_dir) == before


# --- 8: a damaged token-cache sidecar ---------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", [b'{"num_tokens": 12', b"\xff\xfe", b"{}", b"[1, 2]"])
def test_damaged_token_sidecar_is_retokenized(run_dir, tmp_path, caplog, damage):
    """Like a token file of the wrong size: a warning naming the sidecar, then the same tokens, written once."""
    cfg = load_config(run_dir / "config.yaml", [f"data.cache_dir={tmp_path / 'cache'}", "data.max_bytes=40000"])
    tok = load_tokenizer_dir(run_dir / "tokenizer")
    first = prepare_tokens(cfg.data, tok)
    tokens, sidecar = np.array(first.tokens), first.path.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    sidecar.write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="jaxtune.data.tokens"):
        again = prepare_tokens(cfg.data, tok)
    warnings = [r.getMessage() for r in caplog.records if r.name == "jaxtune.data.tokens"]
    assert len(warnings) == 1 and warnings[0].startswith(str(sidecar)) and warnings[0].endswith("; re-tokenizing")
    assert again.path == first.path and np.array_equal(np.asarray(again.tokens), tokens)
    assert first.path.stat().st_size == tokens.nbytes  # rewritten, not appended to
    assert json.loads(sidecar.read_text()) == meta
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.path.name, sidecar.name])


def test_eval_runs_on_through_a_damaged_sidecar(run_dir, tmp_path, capsys, caplog):
    """`jaxtune eval` exits 0 with the same loss when the held-out data's sidecar is damaged."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    assert main(["eval", str(run_dir), cache, "--batches", "1"]) == 0
    loss = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]
    (sidecar,) = (tmp_path / "cache").glob("tokens-*.json")
    sidecar.write_text('{"num_tokens": ')
    with caplog.at_level(logging.WARNING, logger="jaxtune.data.tokens"):
        assert main(["eval", str(run_dir), cache, "--batches", "1"]) == 0
    captured = capsys.readouterr()
    assert f"{sidecar}:1: invalid JSON" in caplog.text and "Traceback" not in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["loss"] == loss


# --- 15: export --overwrite -------------------------------------------------------------------------------------------


def test_export_overwrite_keeps_a_users_file(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(run_dir), str(out)]) == 0
    capsys.readouterr()
    (out / "notes.txt").write_text("my notes\n")
    before = snapshot(out)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(before)

    assert main(["export", str(run_dir), str(out)]) == 2
    assert error_line(capsys)[1] == (f"error: {out} exists and is not empty; choose a new directory, or pass "
                                     "--overwrite to replace an earlier export there")
    assert main(["export", str(run_dir), str(out), "--overwrite"]) == 2
    assert error_line(capsys)[1] == (f"error: {out} holds files an export does not write (notes.txt); --overwrite "
                                     "replaces only an earlier export: move them away, or choose a new directory")
    assert snapshot(out) == before

    (out / "notes.txt").unlink()  # only the export's own files: --overwrite replaces them
    assert main(["export", str(run_dir), str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert set(snapshot(out)) == set(before) - {"notes.txt"}


def test_overwrite_accepts_every_exports_files_and_nothing_else(tmp_path):
    """Native and transformers models (one file or shards with an index), PEFT adapters and tokenizers are an
    earlier export; a subdirectory or any other file is the user's."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors", "model.safetensors.index.json", "adapter_config.json",
                 "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "jaxtune_tokenizer.json"]:
        (out / name).write_text("{}")
    check_out_dir(out, overwrite=True)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        check_out_dir(out, overwrite=False)
    for other in ["README.md", ".gitattributes", "eval.json", "checkpoint-500/"]:
        (out / other.rstrip("/")).mkdir() if other.endswith("/") else (out / other).write_text("x")
        with pytest.raises(FileExistsError, match=re.escape(f"holds files an export does not write ({other})")):
            check_out_dir(out, overwrite=True)
        path = out / other.rstrip("/")
        path.rmdir() if other.endswith("/") else path.unlink()
    (out / "config.json").unlink()
    (out / "config.json").mkdir()  # a directory is never an export's file
    with pytest.raises(FileExistsError, match=r"\(config\.json/\)"):
        check_out_dir(out, overwrite=True)


def test_export_refuses_a_run_without_a_checkpoint(run_dir, tmp_path, capsys):
    """A run that failed before its first save holds no trained weights: exporting it would write the starting
    model as if it were the result. One line, and nothing written."""
    unsaved = tmp_path / "unsaved"
    unsaved.mkdir()
    shutil.copy(run_dir / "config.yaml", unsaved / "config.yaml")
    shutil.copytree(run_dir / "tokenizer", unsaved / "tokenizer")
    out = tmp_path / "export"
    assert main(["export", str(unsaved), str(out)]) == 2
    _, line = error_line(capsys)
    assert f"{unsaved}: the run has no checkpoint yet" in line and "nothing trained to export" in line
    assert not out.exists() and not (out.parent / (out.name + ".gguf")).exists()


def test_switching_the_objective_on_the_command_line_drops_the_files_objective_keys(caplog):
    """dpo-quickstart with objective.name=simpo (its own suggested variant): DPO's beta 0.1 and loss_type yield to
    SimPO's defaults (beta 2.0), with one warning naming what was dropped; keys given again on the command line
    stay; the same objective on the command line changes nothing."""
    with caplog.at_level(logging.WARNING, logger="jaxtune.config.load"):
        cfg = load_config("dpo-quickstart", ["objective.name=simpo"])
    assert cfg.objective.name == "simpo" and cfg.objective.beta_value == 2.0
    assert "objective keys beta, loss_type are dropped" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxtune.config.load"):
        kept = load_config("dpo-quickstart", ["objective.name=simpo", "objective.beta=0.5"])
    assert kept.objective.beta_value == 0.5 and "keys loss_type are dropped" in caplog.text
    assert load_config("dpo-quickstart", ["objective.name=dpo"]).objective.beta_value == 0.1


@pytest.mark.parametrize("where, why", [("/proc/jaxtune-run", "No such file or directory"),
                                        ("FILE/run", "is a file, not a directory")])
def test_a_run_dir_that_cannot_be_made_is_one_line_naming_it(tmp_path, capsys, where, why):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    run = where.replace("FILE", str(blocker))
    assert main(["train", "quickstart", f"run_dir={run}", "train.steps=1"]) == 2
    _, line = error_line(capsys)
    assert line.startswith(f"error: run_dir={run}: cannot create it (") and why in line and "run_dir=runs/NAME" in line
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("command", [["export", "runs/no-such-run", "out"], ["eval", "runs/no-such-run"],
                                     ["generate", "runs/no-such-run", "--prompt", "x"]])
def test_a_run_that_does_not_exist_is_one_line_not_a_config_file_hunt(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    _, line = error_line(capsys)
    assert line == ("error: runs/no-such-run: no such run directory, model directory or config file; pass a run "
                    "directory (the run_dir a training wrote), an exported model directory or a config")
    assert not (tmp_path / "out").exists()


def test_progress_without_a_terminal_is_plain_lines_and_lora_says_what_trains(tmp_path, data_cache, capsys,
                                                                               monkeypatch):
    """Output to a file (not a terminal): no redrawn bar but plain progress lines (here one per step, as if 30 s
    passed each time); the start says how many parameters train (a LoRA run: the adapters' share)."""
    from jaxtune.train import metrics

    monkeypatch.setattr(metrics, "PLAIN_EVERY", 0.0)
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}",
                             "model.family=llama", "model.preset=tiny", "model.lora.rank=4", "train.steps=3",
                             "eval.every=0", "logging.progress=true"])
    train(cfg)
    out, err = capsys.readouterr()
    assert "progress: step 1/3 (33%)" in out and "progress: step 2/3 (67%)" in out and "\r" not in out + err
    # the step-0 evaluation (compiling its programs) has a bar of its own, its parts counted
    what = "step 0: evaluating the starting model (the baseline report.md compares against)"
    assert f"{what}: 0 / 1 parts (0%)" in err and "held-out loss of 2 batches ..." in err
    assert f"{what}: 1 / 1 parts (100%)" in err
    line = next(x for x in out.splitlines() if x.startswith("model: "))
    assert "M parameters" in line and "M trained (" in line and "the LoRA adapters; the base is frozen)" in line
    summary = json.loads((cfg.run_path / "summary.json").read_text())
    assert 0 < summary["trained_params"] < summary["params"]


def test_qlora_states_one_parameter_count_at_its_start_and_end(tmp_path, data_cache, capsys):
    """A QLoRA run (nf4 base) says the same parameter count at its start and in its closing line and summary.json:
    the model's logical parameters (its formula's) plus the adapters, not the quantized kernels' stored values and
    scales (which the start counted, while the end left the adapters out)."""
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec

    over = [*TINY, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}", "model.family=llama",
            "model.lora.rank=4", "model.quantize=nf4", "train.steps=2", "eval.every=0", *QUICK]
    assert main(["train", "quickstart", *over]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cfg = load_config(None, over)
    base = make_state_spec(cfg, None, sharding.make_mesh(1, 1, 1, jax.devices()[:1])).model_cfg.num_params()
    assert summary["params"] == base + summary["trained_params"] and 0 < summary["trained_params"] < base
    said = f"{summary['params'] / 1e6:.2f}M parameters, {summary['trained_params'] / 1e6:.3g}M trained"
    start = next(line for line in out.splitlines() if line.startswith("model: "))
    assert start.startswith(f"model: {said} (") and "its quantized kernels counted as the weights" in start, start
    assert next(line for line in out.splitlines() if line.startswith("done: ")).endswith(f"; {said}")


def test_plain_progress_time_left_leaves_out_the_first_steps_compile(tmp_path, data_cache, capsys, monkeypatch):
    """The time left on a plain progress line comes from the steps after the first, not from the first step's compile
    (which made a 2-minute run say "65.9 min left"): each line's s/step is a small part of the compile's time."""
    from jaxtune.train import metrics

    monkeypatch.setattr(metrics, "PLAIN_EVERY", 0.0)
    train(load_config(None, [*TINY, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}", "train.steps=8",
                             "eval.every=0", "logging.progress=true", "train.compile_ahead=0"]))  # compiled in step 1
    out = capsys.readouterr().out
    compiled = float(re.search(r"step 1: compiled in ([0-9.]+) s", out).group(1))
    lines = [line for line in out.splitlines() if line.startswith("progress: ")]
    assert lines[0] == "progress: step 1/8 (12%)", lines  # no step time measured yet: no time left said
    per_step = [float(re.search(r", ([0-9.]+) s/step, about ([0-9.]+) min left$", line).group(1))
                for line in lines[1:]]
    assert len(per_step) == 6 and compiled > 0, (compiled, lines)


def test_plain_progress_counts_neither_the_first_step_nor_programs_made_later(monkeypatch):
    """The arithmetic of a plain line, on a clock the test sets (the run above may find its programs in the compile
    cache, so its first step is not reliably slow): step 1 takes 60 s (its compile), every later step 0.5 s, and a
    program made during step 4 takes 10 s more; each line says 0.50 s/step and the time left at that rate."""
    from jaxtune.train import metrics

    clock, compiled = [0.0], [0.0]
    monkeypatch.setattr(metrics, "PLAIN_EVERY", 0.0)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(metrics, "compile_seconds", lambda: compiled[0])
    progress = metrics.PlainProgress(0, 100)
    lines = []
    monkeypatch.setattr("builtins.print", lambda line, **_: lines.append(line))
    for step in range(1, 8):
        clock[0] += 60.0 if step == 1 else 0.5
        if step == 4:
            clock[0] += 10.0
            compiled[0] += 10.0
        progress.advance(1)
    assert lines[0] == "progress: step 1/100 (1%)", lines
    for step, line in enumerate(lines[1:], start=2):
        assert line == f"progress: step {step}/100 ({step}%), 0.50 s/step, about {(100 - step) * 0.5 / 60:.1f} min left"


def test_report_after_a_resume_keeps_one_table_from_step_0(tmp_path, data_cache):
    """A run stopped at step 2 and resumed to step 4: report.md is one report whose table has the evaluations of
    both attempts (0, 2, 4), not a second table whose "before" is the resume step."""
    base = [*TINY, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}", "eval.every=2", "eval.batches=1",
            "checkpoint.every=2"]
    train(load_config(None, [*base, "train.steps=2"]))
    train(load_config(None, [*base, "train.steps=4"]))
    report = (tmp_path / "run" / "report.md").read_text()
    assert report.count("# Run report") == 1 and report.count("| step | held-out loss |") == 1, report
    steps = [line.split("|")[1].strip() for line in report.splitlines() if line.startswith("| ") and "--" not in line]
    assert steps[1:] == ["0", "2", "4"], report  # after the header row


KTO_ROW = {"prompt": "Is 2+2 4?", "completion": "Yes.", "label": True}
PAIR_ROW = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
CHAT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PROMPT_ROW = {"prompt": "2+2?", "answer": "4"}
PREFERENCE = ["objective.name=dpo", "data.format=preference"]
SFT = ["data.format=messages", "data.chat_template=chatml"]


def takers(kind: BatchKind) -> str:
    """The objectives that train on ``kind``, from the records, as the errors list them: "a, b or c"."""
    names = objectives_for(kind)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@pytest.mark.parametrize("row, overrides, says", [
    (KTO_ROW, PREFERENCE, ("this row is an unpaired preference row {prompt, completion, label} "
                           "(data.format=unpaired, for objective.name=kto), but data.format=preference reads a "
                           f"preference pair {{prompt, chosen, rejected}}, for objective.name={takers(PAIRS)}; "
                           "give rows of that shape, or train on these with data.format=unpaired objective.name=kto")),
    (CHAT_ROW, PREFERENCE, ("this row is a chat conversation (data.format=messages, for "
                            "objective.name=cross_entropy), but data.format=preference reads a preference pair")),
    (PROMPT_ROW, PREFERENCE, ("this row is a prompt alone {prompt, answer fields} (data.format=prompts, for "
                              f"objective.name={takers(PROMPTS)}), but data.format=preference reads")),
    (PAIR_ROW, SFT, ("this row is a preference pair {prompt, chosen, rejected} (data.format=preference, for "
                     f"objective.name={takers(PAIRS)}), but data.format=messages reads a chat conversation, "
                     "for objective.name=cross_entropy; give rows of that shape, or train on these with "
                     "data.format=preference objective.name=dpo")),
    (PROMPT_ROW, SFT, "this row is a prompt alone"),
    # An SFT format that would read it, ignoring the label, would train on the disliked completions too.
    (KTO_ROW, ["data.format=prompt_completion"], ("this row is an unpaired preference row {prompt, completion, "
                                                  "label} (data.format=unpaired, for "
                                                  "objective.name=kto): fine-tuning on it would train on the "
                                                  "disliked completions too; train it with data.format=unpaired "
                                                  "objective.name=kto, or keep the rows labelled true and drop their "
                                                  "'label' field")),
], ids=["kto-to-dpo", "messages-to-dpo", "prompts-to-dpo", "pairs-to-sft", "prompts-to-sft", "kto-to-sft"])
def test_data_of_another_shape_says_what_it_is_and_what_takes_it(tmp_path, data_cache, capsys, row, overrides,
                                                                  says):
    """Rows of another format (or TRL's unpaired KTO rows) given to an objective: one line naming the file:line, what
    the rows look like, and which data.format and objective read them; not "set data.fields.chosen" (which cannot
    help) nor "set data.bad_rows=drop" (which would drop every row); no checkpoint written."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    run = tmp_path / "run"
    assert main(["train", "quickstart", *[o for o in TINY if not o.startswith("data.sources")], *overrides,
                 f"data.sources=[{data}]", f"data.cache_dir={data_cache}", f"run_dir={run}", "train.steps=1"]) == 2
    _, line = error_line(capsys)
    assert line.startswith(f"error: {data}:1: {says}") and "bad_rows" not in line and "data.fields" not in line
    assert not list(run.glob("checkpoints/*"))


@pytest.mark.parametrize("where, why", [("/proc/jaxtune-export", "No such file or directory (ENOENT)"),
                                        ("FILE/out", "is a file, not a directory")])
@pytest.mark.parametrize("flags", [[], ["--gguf"]], ids=["hf", "gguf"])
def test_an_export_target_that_cannot_be_written_is_one_line_naming_it(run_dir, tmp_path, capsys, where, why,
                                                                       flags):
    """The path the user gave, not the temporary one beside it that the atomic write would have failed on."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = where.replace("FILE", str(blocker)) + (".gguf" if flags else "")
    before = snapshot(run_dir)
    assert main(["export", str(run_dir), out, *flags]) == 2
    _, line = error_line(capsys)
    assert line.startswith(f"error: export to {out}: cannot write there (") and why in line and ".partial" not in line
    assert blocker.read_text() == "x" and snapshot(run_dir) == before


def test_a_cache_dir_that_cannot_be_written_is_one_line_naming_the_key(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["train", "quickstart", *TINY, f"data.cache_dir={blocker}/cache", f"run_dir={tmp_path / 'run'}",
                 "train.steps=1"]) == 2
    _, line = error_line(capsys)
    assert line == (f"error: data.cache_dir={blocker}/cache: cannot write there ({blocker} is a file, not a "
                    "directory); choose a place you can write")
    assert blocker.read_text() == "x"


def test_a_key_of_another_objective_is_refused_at_its_default_on_the_command_line(tmp_path, capsys):
    """`jaxtune train reward-model-quickstart objective.loss_type=sigmoid` (DPO's default loss type, which a reward
    model ignores) is refused before anything runs, as ipo is, in one line naming the key, the objective and what to
    do; the key does not vanish from a run that trains."""
    for value in ("sigmoid", "ipo"):
        run = tmp_path / value
        assert main(["train", "reward-model-quickstart", f"objective.loss_type={value}", f"run_dir={run}"]) == 2
        _, line = error_line(capsys)
        assert line.startswith("error: invalid config (") and line.endswith(
            "objective: objective.loss_type does not apply to objective.name=reward: drop it, or choose an objective "
            "that takes it (dpo, grpo, kto); reward's keys: center_rewards_coefficient")
        assert not run.exists()


GRPO = ["objective.name=grpo", "data.format=prompts", "objective.rewards=[{name: exact_number, field: answer}]"]


@pytest.mark.parametrize("overrides, says", [
    (GRPO, "train.batch_size=16 is ambiguous for objective.name=grpo"),
    ([*GRPO, "train.batch_size=null", "objective.prompts_per_step=2", "data.seq_len=64",
      "objective.max_completion_length=64"], "objective.max_completion_length=64 leaves no room for a prompt"),
    (["data.max_prompt_length=8"], "data.max_prompt_length applies to data.format=preference, unpaired, prompts"),
    (["objective.name=dpo"], "objective.name=dpo trains on pairs"),
    (["objective.name=dpo", "data.format=preference", "objective.loss_type=dapo"],
     "objective.loss_type=dapo does not apply to objective.name=dpo"),
    (["objective.name=dpo", "data.format=preference", "objective.loss_type=[sigmoid,bco_pair,sft]",
      "objective.loss_weights=[1.0,0.5]"], ("objective.loss_weights=[1.0, 0.5] gives 2 weights for 3 loss types "
                                            "(sigmoid, bco_pair, sft): give 3, one per loss type of "
                                            "objective.loss_type, in order")),
], ids=["grpo-batch-size", "no-room-for-a-prompt", "prompt-limit-on-text", "objective-on-other-data",
        "other-objectives-loss-type", "too-few-loss-weights"])
def test_a_cross_field_config_error_names_the_keys_not_the_whole_config(tmp_path, capsys, overrides, says):
    assert main(["train", "quickstart", *overrides, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and says in err
    assert "{'" not in err and "input_value" not in err and len(err.splitlines()) <= 3
    assert not (tmp_path / "run").exists()


def test_on_a_terminal_the_error_line_replaces_a_bar_left_mid_line(tmp_path, monkeypatch):
    """A bar redrawn in place (no newline yet) when the error comes: the error clears that line and takes it, instead
    of being glued to the bar's text."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Terminal()
    err.write("\r[#####...] step 0: evaluating: 1 / 2 parts")  # a bar mid-line
    monkeypatch.setattr(sys, "stderr", err)
    (tmp_path / "a-file").write_text("x")
    assert main(["train", "quickstart", f"run_dir={tmp_path / 'a-file'}/x", "train.steps=1"]) == 2
    assert err.getvalue().endswith("\r\x1b[Kerror: run_dir=" + f"{tmp_path / 'a-file'}/x: cannot create it ("
                                   f"{tmp_path / 'a-file'} is a file, not a directory); set run_dir to a directory "
                                   "you can write, e.g. run_dir=runs/NAME\n")


@pytest.mark.parametrize("made, says", [
    (lambda d: d / "no-such-model", "no such directory"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "no config.json"),
], ids=["missing", "no-config-json"])
def test_a_model_directory_error_says_the_directory_once(tmp_path, capsys, made, says):
    """`jaxtune info` on a model.from_hf that is not a model directory: one line, printed once, naming the directory
    once (it read "model.from_hf=DIR: DIR: no config.json", and called a missing directory one without config.json)."""
    directory = made(tmp_path)
    assert main(["info", "quickstart", f"model.from_hf={directory}"]) == 2
    _, line = error_line(capsys)
    assert line == (f"error: model.from_hf={directory}: {says}; pass a HuggingFace model directory (save_pretrained "
                    "output, `jaxtune export RUN_DIR DIR` of a trained run, or a hub snapshot)")
    assert line.count(str(directory)) == 1
