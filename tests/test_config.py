"""Config: every shipped config validates; unknown keys, bad types and bad YAML are named errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jaxtune.config import SHIPPED_CONFIGS, Config, ConfigError, identity_diff, load_config
from jaxtune.models import model_config

SHIPPED = sorted(SHIPPED_CONFIGS.glob("*.yaml"))


def test_configs_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {"quickstart", "gpt2-124m", "minigpt-tinystories"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_builds_its_model_config(path):
    cfg = load_config(path)
    mcfg = model_config(cfg.model, cfg.tokenizer.vocab_size)
    assert mcfg.max_seq_len >= cfg.data.seq_len
    assert cfg.train.batch_size % cfg.train.micro_batches == 0


def test_shipped_config_by_name_and_recipes():
    gpt2 = load_config("gpt2-124m")
    assert (gpt2.optim.name, gpt2.optim.warmup_steps, gpt2.optim.schedule) == ("adamw", 715, "cosine")
    assert gpt2.optim.weight_decay == 0.1
    assert model_config(gpt2.model).num_params() == pytest.approx(124.5e6, rel=0.01)
    mini = model_config(load_config("minigpt-tinystories").model)
    assert (mini.n_layer, mini.d_model, mini.n_head, mini.max_seq_len) == (8, 512, 8, 256)


def test_overrides_are_typed_and_nested():
    cfg = load_config("quickstart", ["train.steps=7", "optim.lr=1e-3", "data.sources=[a.txt, b.txt]", "name=x"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == 1e-3
    assert cfg.data.sources == ["a.txt", "b.txt"]
    assert str(cfg.run_path).endswith("runs/quickstart")  # run_dir from the file wins over name


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key; did you mean optim\.lr\?"):
        load_config("quickstart", ["optim.lrr=3"])
    with pytest.raises(ConfigError, match=r"trian: unknown key; did you mean train\?"):
        load_config(None, ["trian.steps=3"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"train\.steps: .*integer.*'abc'"):
        load_config(None, ["train.steps=abc"])
    with pytest.raises(ConfigError, match=r"model\.remat"):
        load_config(None, ["model.remat=sometimes"])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="not divisible by train.micro_batches"):
        load_config(None, ["train.batch_size=6", "train.micro_batches=4"])
    with pytest.raises(ConfigError, match="at most one -1"):
        load_config(None, ["mesh.data=-1", "mesh.fsdp=-1"])
    with pytest.raises(ConfigError, match="tokenizer.path"):
        load_config(None, ["tokenizer.kind=hf"])


def test_bad_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  n_layer: 2\n  n_head: [4\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(p)


def test_missing_config_lists_shipped(tmp_path):
    with pytest.raises(ConfigError, match="quickstart"):
        load_config(tmp_path / "nope.yaml")


def test_frozen():
    cfg = load_config(None)
    with pytest.raises(ValidationError):
        cfg.train.steps = 3  # type: ignore[misc]
    assert isinstance(cfg, Config)


def test_identity_diff_lists_only_identity_keys():
    a = load_config(None, ["model.n_layer=2", "train.steps=10"]).to_dict()
    b = load_config(None, ["model.n_layer=3", "train.steps=20", "train.seed=5", "logging.every=3"]).to_dict()
    diff = identity_diff(a, b)
    assert any(d.startswith("model.n_layer") for d in diff)
    assert any(d.startswith("train.seed") for d in diff)
    assert not any(d.startswith(("train.steps", "logging.")) for d in diff)
