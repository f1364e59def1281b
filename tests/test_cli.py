"""Every CLI command end to end: in-process through `main`, and the installed console script on the
shipped quickstart config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxtune.cli import main
from jaxtune.config import load_config


@pytest.fixture
def config_file(tmp_path, tiny_overrides) -> Path:
    """The tiny test config written as YAML, as a user would."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(load_config(None, tiny_overrides + ["train.steps=6"]).to_dict()))
    return path


def test_train_eval_generate_info(config_file, capsys):
    assert main(["train", str(config_file), "checkpoint.every=3"]) == 0
    run_dir = load_config(config_file).run_path
    assert (run_dir / "checkpoints" / "6").is_dir()
    capsys.readouterr()

    assert main(["eval", str(run_dir)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 6 and result["loss"] > 0 and result["perplexity"] == pytest.approx(
        2.718281828 ** result["loss"], rel=1e-6)

    assert main(["eval", str(config_file)]) == 0  # a config resolves to its run directory
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"] == result["loss"]

    assert main(["generate", str(run_dir), "--prompt", "import os", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import os") and len(out) > len("import os\n")

    assert main(["generate", str(run_dir), "--prompt", "def", "--prompt", "class Foo", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "--- 'def'" in out and "--- 'class Foo'" in out

    assert main(["info", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert "parameters:" in out and "FLOPs per token" in out and "memory / device" in out


def test_user_errors_exit_2_with_the_key(config_file, capsys):
    assert main(["train", str(config_file), "optim.lrr=1"]) == 2
    assert "did you mean optim.lr?" in capsys.readouterr().err
    assert main(["eval", "/nonexistent/run"]) == 2
    assert "/nonexistent/run: no such run directory, model directory or config file" in capsys.readouterr().err
    assert main(["train", str(config_file), "data.sources=[/nonexistent/corpus.txt]"]) == 2
    assert "/nonexistent/corpus.txt" in capsys.readouterr().err


def test_console_script_runs_the_shipped_quickstart(tmp_path, data_cache):
    """README command 1, shortened: the installed `jaxtune` on the shipped quickstart config."""
    exe = shutil.which("jaxtune") or str(Path(sys.executable).parent / "jaxtune")
    run_dir = tmp_path / "qs"
    cmd = [exe, "train", "quickstart", f"run_dir={run_dir}", f"data.cache_dir={data_cache}", "train.steps=4",
           "data.max_bytes=1000000", "tokenizer.train_bytes=500000", "eval.every=0", "eval.max_new_tokens=8",
           "checkpoint.every=2", "logging.every=1"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation loss" in proc.stdout + proc.stderr and "sample @ step 4" in proc.stdout + proc.stderr
    for name in ("loss.png", "metrics.jsonl", "config.yaml", "checkpoints/4", "tokenizer/tokenizer.json"):
        assert (run_dir / name).exists(), name


def test_info_plans_a_mesh_of_hypothetical_devices(capsys):
    """`jaxtune info CONFIG --devices N --mesh ...` gives per-device memory for a pod from one CPU: FSDP over 8
    devices holds an eighth of the params of one device, and a non-dividing layout is a named error."""
    from jaxtune.cli import main

    assert main(["info", "gpt2-124m", "--devices", "1", "--mesh", "data=1"]) == 0
    one = capsys.readouterr().out
    assert main(["info", "gpt2-124m", "--devices", "8", "--mesh", "data=1,fsdp=8"]) == 0
    eight = capsys.readouterr().out
    assert "{'data': 1, 'fsdp': 8, 'context': 1, 'tensor': 1} over 8 device(s)" in eight
    params = lambda out: float(out.split("params ")[-1].split(" GiB")[0])
    assert abs(params(one) / params(eight) - 8) < 0.1
    assert main(["info", "gpt2-124m", "--devices", "7", "--mesh", "data=1,fsdp=7"]) == 2
    assert "does not divide mesh axis fsdp of size 7" in capsys.readouterr().err


def test_info_compile_for_without_libtpu_is_one_line_naming_the_extra(capsys, monkeypatch):
    """The README's plan command on an install without the aot extra: exit 2 and one line saying what to install,
    nothing printed before it (what an environment without the package gives, whether or not this one has it)."""
    monkeypatch.setitem(sys.modules, "libtpu", None)
    assert main(["info", "gemma3-1b-grpo", "--compile-for", "v5e-8"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --compile-for v5e-8: compiling for a TPU needs libtpu; pip install 'jaxtune[aot]'")
    assert "pip install -e '.[aot]'" in err


def test_console_script_runs_the_fine_tuning_quickstart(tmp_path, data_cache):
    """The fine-tuning quickstart, shortened: chat SFT on the generated data, offline; the data report, the
    step-0 baseline and the run report's before/after samples are there, and --chat generation runs."""
    exe = shutil.which("jaxtune") or str(Path(sys.executable).parent / "jaxtune")
    run_dir = tmp_path / "fq"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [exe, "train", "finetune-quickstart", f"run_dir={run_dir}", f"data.cache_dir={data_cache}",
           "train.steps=4", "eval.every=0", "eval.max_new_tokens=6", "checkpoint.every=4", "logging.every=2",
           "eval.batches=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fine-tuning data: 10000 rows" in out and "step 0: validation loss" in out
    report = (run_dir / "report.md").read_text()
    assert "Before (step 0)" in report and "After (step 4)" in report and "user: What is 12 plus 30?" in report
    proc = subprocess.run([exe, "generate", str(run_dir), "--chat", "--prompt", "What is 2 plus 2?",
                           "--max-new-tokens", "4", "--temperature", "0"], capture_output=True, text=True, timeout=300,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
