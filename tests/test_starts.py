"""Starting a run: from a HuggingFace checkpoint that is a local directory, a hub name with no hub to reach, or a
cached one (issue items 9 and 11); planning a hub recipe offline (10); what a resume may change (12).

The hub is never reached: commands that would ask it run in a subprocess whose HF_ENDPOINT is a closed local port
(an unreachable hub, whatever the machine's network) and whose HF_HOME is the test's own cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.tiny_hf import save_chatml_tokenizer

from jaxtune.cli import main
from jaxtune.config import (
    MODEL_SECTIONS,
    RESUMABLE_KEYS,
    SHIPPED_CONFIGS,
    Config,
    ConfigError,
    identity_diff,
    is_identity_key,
    load_config,
)
from jaxtune.info import format_info, info
from jaxtune.models import model_config
from jaxtune.models.resolve import HUB_PRESETS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once
# A small `jaxtune train quickstart` (shapes of the recipe, less data and fewer steps).
SMALL = ["train.steps=2", "train.batch_size=2", "data.max_bytes=100000",
         "eval.batches=1", "eval.prompts=[]", "logging.every=1", "logging.progress=false", "logging.tensorboard=false"]
# What the quickstart recipe's model section sets that a checkpoint decides instead (as its tokenizer section).
RECIPE_MODEL = ("family", "n_layer", "n_head", "d_model", "max_seq_len")


def _cli(args: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """``jaxtune ARGS`` in a fresh process whose hub is unreachable and whose HuggingFace cache is the test's own."""
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    full = {**base, "JAX_PLATFORMS": "cpu", "HF_ENDPOINT": CLOSED_PORT, "HF_HOME": str(tmp_path / "hf-home"), **env}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", *args], capture_output=True, text=True, env=full,
                         timeout=600, check=False)
    return out, time.perf_counter() - start


def _one_error_line(stderr: str) -> str:
    """The one line a user error prints (no traceback, no retry warnings), without its ``error: ``."""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0][len("error: "):]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers (256 positions) with its own byte-level BPE tokenizer."""
    d = tmp_path_factory.mktemp("hf-tiny-llama")
    texts = [Path(shutil.__file__).read_text()[:50_000]]
    vocab = save_chatml_tokenizer(d, texts)
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                 tie_word_embeddings=True, eos_token_id=0, bos_token_id=0)
    transformers.LlamaForCausalLM(c).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory, data_cache) -> Path:
    """The run directory of a small `jaxtune train quickstart`, finished at step 2."""
    run = tmp_path_factory.mktemp("quickstart") / "run"
    assert main(["train", "quickstart", *SMALL, f"run_dir={run}", f"data.cache_dir={data_cache}"]) == 0
    assert (run / "checkpoints" / "2").is_dir()
    return run


# --- 9: a hub name with no hub to reach, a missing local directory ---

def test_unreachable_hub_is_one_line_naming_model_from_hf_and_the_ways_on(tmp_path):
    """Offline, a hub recipe stops after one attempt (seconds, not 53 s of retries) with one line that names
    model.from_hf (the key the recipe set, not tokenizer.path) and the two ways on; the user's data is untouched."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    run = tmp_path / "run"
    out, seconds = _cli(["train", "gemma3-270m-lora", f"data.sources=[{data}]", f"run_dir={run}"], tmp_path)
    assert out.returncode == 2, out.stderr
    name, cache = "google/gemma-3-270m-it", re.escape(str(tmp_path / "hf-home" / "hub"))
    assert re.fullmatch(
        re.escape(f"model.from_hf={name}: not a local directory, nor in the HuggingFace cache (") + cache
        + re.escape(f"), and the HuggingFace hub at {CLOSED_PORT} cannot be reached (") + r"ConnectError: [^()]+"
        + re.escape(f"); pass a local directory (model.from_hf=DIR: a save_pretrained or `hf download {name} "
                    f"--local-dir DIR` copy) or set HF_HUB_OFFLINE=1 with {name} in the cache (`hf download {name}` "
                    "where there is network)"),
        _one_error_line(out.stderr)), out.stderr
    assert seconds < 30  # the whole command, interpreter and imports included; the hub part is one refused connect
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert data.read_text().startswith('{"messages"')


def test_hf_hub_offline_without_the_model_cached_is_one_line(tmp_path):
    out, _ = _cli(["train", "gemma3-270m-lora", f"run_dir={tmp_path / 'run'}"], tmp_path, HF_HUB_OFFLINE="1")
    name = "google/gemma-3-270m-it"
    assert out.returncode == 2
    assert _one_error_line(out.stderr) == (
        f"model.from_hf={name}: not a local directory, nor in the HuggingFace cache ({tmp_path / 'hf-home' / 'hub'}), "
        f"and HF_HUB_OFFLINE is set; pass a local directory (model.from_hf=DIR: a save_pretrained or `hf download "
        f"{name} --local-dir DIR` copy) or fill the cache (`hf download {name}` where there is network)")


def test_missing_local_from_hf_directory_names_model_from_hf(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["train", "quickstart", f"model.from_hf={missing}", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: model.from_hf={missing}: no such directory; give a HuggingFace model directory (a "
                   "trained run becomes one with `jaxtune export RUN_DIR DIR`) or a hub name\n")


def test_hub_name_runs_from_a_filled_cache_when_the_hub_is_unreachable(hf_dir, tmp_path, data_cache):
    """The way on the message names: the model in the HuggingFace cache (here laid out as `hf download` leaves it).
    With the hub unreachable, one request finds that out and the cached copy trains; with HF_HUB_OFFLINE=1 no request
    is made and `jaxtune info` reads the cached config.json (no preset note). The run's programs go to its compile
    cache, which JAX reads and writes under a file lock there (a bounded cache: `loop.COMPILE_CACHE_BYTES`), so a
    process never reads an entry another is still writing."""
    repo = tmp_path / "hf-home" / "hub" / "models--tiny-org--tiny-llama"
    sha = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(hf_dir, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    run = tmp_path / "run"
    out, _ = _cli(["train", "quickstart", "model.from_hf=tiny-org/tiny-llama", f"run_dir={run}", *SMALL,
                   f"data.cache_dir={data_cache}", f"train.compile_cache_dir={tmp_path / 'xla'}"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "xla" / ".lockfile").is_file() and list((tmp_path / "xla").glob("jit_*-cache"))
    assert "Traceback" not in out.stderr and "Retrying" not in out.stderr
    used = [line for line in out.stderr.splitlines() if "using the cached copy of tiny-org/tiny-llama" in line]
    assert len(used) == 1 and f"the HuggingFace hub at {CLOSED_PORT} cannot be reached" in used[0]
    assert (run / "checkpoints" / "2").is_dir()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["from_hf"] == "tiny-org/tiny-llama" and saved["tokenizer"]["kind"] == "hf"

    out, _ = _cli(["info", "quickstart", "model.from_hf=tiny-org/tiny-llama"], tmp_path, HF_HUB_OFFLINE="1")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("model:            DecoderConfig(vocab_size=300, max_seq_len=256,")


# --- 10: planning a hub recipe offline ---

def test_info_plans_a_hub_recipe_from_its_preset_offline(tmp_path):
    """`jaxtune info gemma3-270m-lora` with the hub unreachable: the plan of the gemma3-270m preset with the recipe's
    dtypes and LoRA, under one line that says so."""
    out, seconds = _cli(["info", "gemma3-270m-lora"], tmp_path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    note, *plan = out.stdout.splitlines()
    assert re.fullmatch(
        re.escape("note:             model.from_hf=google/gemma-3-270m-it: config.json cannot be read: the HuggingFace "
                  f"hub at {CLOSED_PORT} cannot be reached (") + r"ConnectError: [^()]+"
        + re.escape("), and google/gemma-3-270m-it is not in the HuggingFace cache; planned from the gemma3 preset "
                    "gemma3-270m, which has the same shapes"), note), note
    cfg = load_config("gemma3-270m-lora")
    preset = cfg.model_copy(update={"model": cfg.model.model_copy(update={"from_hf": None, "family": "gemma3",
                                                                           "preset": "gemma3-270m"})})
    assert plan == format_info(info(preset)).splitlines()  # nothing of the recipe lost: dtypes, LoRA, batch, mesh
    assert "parameters:       268,098,176" in out.stdout and "1,898,496 trained" in out.stdout
    assert seconds < 60


def test_every_shipped_native_hub_recipe_has_a_preset_to_plan_from():
    for path in sorted(SHIPPED_CONFIGS.glob("*.yaml")):
        cfg = load_config(path)
        hub_name = cfg.model.from_hf and cfg.model.from_hf.count("/") == 1  # not a local run's export (dpo-quickstart)
        if cfg.model.backend == "native" and hub_name:
            family, preset = HUB_PRESETS[cfg.model.from_hf]
            assert model_config(cfg.model.model_copy(update={"from_hf": None, "family": family, "preset": preset}))


def test_info_of_an_unknown_hub_name_is_one_line(capsys):
    assert main(["info", "quickstart", "model.from_hf=no-such-org/no-such-model"]) == 2
    assert capsys.readouterr().err.startswith("error: model.from_hf=no-such-org/no-such-model: not a local directory")


# --- 11: the README's `jaxtune train quickstart model.from_hf=DIR data.seq_len=256` ---

def test_from_hf_override_takes_family_shapes_and_tokenizer_over_the_recipe(hf_dir):
    cfg = load_config("quickstart", [f"model.from_hf={hf_dir}", "data.seq_len=256"])
    assert all(getattr(cfg.model, k) is None for k in RECIPE_MODEL)
    assert cfg.tokenizer.kind == "hf" and cfg.tokenizer.path == str(hf_dir)
    assert (cfg.model.dropout, cfg.optim.lr, cfg.data.seq_len) == (0.0, 2e-3, 256)  # the rest of the recipe stays
    mcfg = model_config(cfg.model, 300)
    assert (mcfg.family, mcfg.n_layer, mcfg.d_model, mcfg.max_seq_len, mcfg.vocab_size) == ("llama", 2, 32, 256, 300)
    # An explicit shape next to model.from_hf is still an error; an explicit tokenizer is kept.
    with pytest.raises(ConfigError, match="model.n_layer cannot be set with model.from_hf"):
        model_config(load_config("quickstart", [f"model.from_hf={hf_dir}", "model.n_layer=3"]).model)
    kept = load_config("quickstart", [f"model.from_hf={hf_dir}", "tokenizer.kind=hf", "tokenizer.path=elsewhere"])
    assert kept.tokenizer.path == "elsewhere"
    assert load_config("quickstart").model.family == "gpt2"  # without from_hf the recipe is as written


def test_readme_from_hf_command_runs_in_a_new_run_dir(hf_dir, tmp_path, data_cache, capsys):
    run = tmp_path / "from-hf"
    assert main(["train", "quickstart", f"model.from_hf={hf_dir}", "data.seq_len=256", f"run_dir={run}", *SMALL,
                 f"data.cache_dir={data_cache}"]) == 0
    assert (run / "checkpoints" / "2").is_dir() and (run / "tokenizer" / "tokenizer.json").is_file()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["from_hf"] == str(hf_dir) and saved["model"]["family"] is None
    assert "Traceback" not in capsys.readouterr().err


def test_readme_from_hf_command_in_the_quickstart_run_dir_says_to_pick_a_new_one(quickstart_run, hf_dir, data_cache,
                                                                                 capsys):
    before = _files(quickstart_run)
    assert main(["train", "quickstart", f"model.from_hf={hf_dir}", "data.seq_len=256", f"run_dir={quickstart_run}",
                 *SMALL, f"data.cache_dir={data_cache}"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == f"error: {quickstart_run} holds a checkpoint (step 2) of a different run; these keys differ:"
    assert f"  model.from_hf: checkpoint has None, config has '{hf_dir}'" in lines
    assert "Use another run_dir" in lines[-1] and "Traceback" not in err
    assert _files(quickstart_run) == before  # nothing of the earlier run lost or rewritten


# --- 12: what a resume may change ---

def _keys(d: dict, prefix: str = "") -> set[str]:
    """Dotted keys of a config dict (free-form mappings, data.fields and data.roles, as one key)."""
    out = set()
    for k, v in d.items():
        nested = isinstance(v, dict) and k not in ("fields", "roles")
        out |= _keys(v, f"{prefix}{k}.") if nested else {f"{prefix}{k}"}
    return out


def test_every_config_key_is_identity_or_resumable():
    """Each key of every section (both backends' model keys) is on exactly one list: a new key must be placed."""
    keys = _keys(Config().to_dict())
    keys |= {f"model.{k}" for cls in MODEL_SECTIONS.values() for k in cls.model_fields if k != "lora"}
    for key in sorted(keys):
        resumable = any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS)
        assert is_identity_key(key) != resumable, key


def test_identity_has_math_and_data_order_keys_only():
    base = load_config(None).to_dict()

    def changed(key: str, value) -> list[str]:
        section, name = key.split(".")
        return identity_diff(base, {**base, section: {**base[section], name: value}})

    assert changed("optim.lr", 1e-3) == ["optim.lr: checkpoint has 0.0003, config has 0.001"]  # the math
    assert changed("data.seq_len", 128) == ["data.seq_len: checkpoint has 256, config has 128"]  # the data order
    for key, value in [("data.cache_dir", "/elsewhere"), ("train.steps", 5), ("model.remat", "full"),
                       ("train.compile_cache_dir", "/c"), ("logging.every", 1), ("mesh.fsdp", 2),
                       ("checkpoint.every", 7), ("eval.every", 3)]:
        assert changed(key, value) == [], key


def test_resume_with_another_data_cache_dir_continues(quickstart_run, tmp_path, data_cache, capsys):
    run = tmp_path / "run"
    shutil.copytree(quickstart_run, run)
    assert main(["train", "quickstart", *SMALL, "train.steps=3", f"run_dir={run}",
                 f"data.cache_dir={tmp_path / 'other-cache'}"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]  # resumed at 2, not started over
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())[-2:] == [2, 3]


@pytest.mark.parametrize("change, line", [
    ("optim.lr=1e-3", "  optim.lr: checkpoint has 0.002, config has 0.001"),
    ("data.seq_len=64", "  data.seq_len: checkpoint has 128, config has 64"),
])
def test_resume_changing_the_math_or_the_data_order_is_refused(quickstart_run, data_cache, change, line, capsys):
    before = _files(quickstart_run)
    assert main(["train", "quickstart", *SMALL, change, f"run_dir={quickstart_run}",
                 f"data.cache_dir={data_cache}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1:-1] == [line] and lines[-1].startswith("Use another run_dir")
    assert _files(quickstart_run) == before
