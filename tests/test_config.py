"""Config: every shipped config validates; unknown keys, bad types and bad YAML are named errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from jaxtune.config import (
    OBJECTIVE_SECTIONS,
    SHIPPED_CONFIGS,
    Config,
    ConfigError,
    config_from_dict,
    identity_diff,
    load_config,
    objective_config,
)
from jaxtune.config.identity import RESPELLED
from jaxtune.models import model_config
from jaxtune.models.resolve import HUB_PRESETS
from jaxtune.models.wheels import installed_file, is_wheel_ref, wheel_model

SHIPPED = sorted(SHIPPED_CONFIGS.glob("*.yaml"))


def test_configs_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {"quickstart", "gpt2-124m", "minigpt-tinystories", "finetune-quickstart", "gemma3-270m-lora",
            "gemma3-1b-lora-dolly", "gemma3-1b-full-adafactor", "qwen-lora", "llama-lora", "dpo-quickstart",
            "qwen-dpo-ultrafeedback", "grpo-quickstart", "rloo-quickstart", "gkd-quickstart",
            "kto-quickstart"} <= names


# Fine-tuning recipes start from hub checkpoints, which tests cannot download: their model config is checked on
# the family preset with the same shapes (`jaxtune.models.resolve.HUB_PRESETS`, which the plan reads too).


# Recipes that start from another recipe's run, exported (`jaxtune export`): checked on that recipe's model.
LOCAL_STARTS = {"runs/finetune-quickstart/model": "finetune-quickstart",
                "runs/sft-careless/model": "finetune-quickstart",
                "runs/student-careless/model": "finetune-quickstart",
                "runs/agent-sft/model": "agent-sft-quickstart",
                "runs/smollm2-agent-sft/model": "smollm2-agent-sft"}


# torchax recipes: a tiny transformers config of the hub model's architecture, to build it with the recipe's LoRA.
TORCHAX_HUB = {"microsoft/Phi-3-mini-4k-instruct": ("Phi3Config", {"pad_token_id": 0})}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_builds_its_model_config(path, tmp_path):
    cfg = load_config(path)
    model = cfg.model
    if model.backend == "torchax":  # the recipe's LoRA targets exist in (a tiny model of) its architecture
        transformers = pytest.importorskip("transformers")
        from jaxtune.backends.torchax.model import build_torch_model

        cls, extra = TORCHAX_HUB[model.from_hf]
        getattr(transformers, cls)(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, **extra).save_pretrained(tmp_path)
        module = build_torch_model(model.model_copy(update={"from_hf": None, "hf_config": str(tmp_path)}), 0)
        assert any("lora_A" in n for n, _ in module.named_parameters())
        return
    if model.from_hf in LOCAL_STARTS:  # a recipe that starts from another recipe's exported model
        model = load_config(LOCAL_STARTS[model.from_hf]).model
    if is_wheel_ref(model.from_hf or ""):  # a real model shipped as wheels: its converted config.json
        pytest.importorskip("gguf")
        if installed_file(model.from_hf) is None:
            pytest.skip(f"{model.from_hf} absent: {wheel_model(model.from_hf).install}")
    elif model.from_hf:
        family, preset = HUB_PRESETS[model.from_hf]
        model = model.model_copy(update={"from_hf": None, "family": family, "preset": preset})
    mcfg = model_config(model, None if cfg.model.from_hf else cfg.tokenizer.vocab_size)
    assert mcfg.max_seq_len >= cfg.data.seq_len
    assert cfg.train.batch_size % cfg.train.micro_batches == 0
    if cfg.model.lora.rank:
        assert mcfg.lora is not None and mcfg.lora.targets == tuple(cfg.model.lora.targets)
    if cfg.data.format != "text":
        assert cfg.data.chat_template or cfg.model.from_hf or cfg.data.format == "prompt_completion"


def test_fine_tuning_recipes_hold_their_seeds_settings():
    g270 = load_config("gemma3-270m-lora")  # seed 004
    assert (g270.model.lora.rank, g270.model.lora.alpha) == (8, 16)
    assert g270.model.lora.targets == ["q", "k", "v", "o", "gate", "up", "down"]
    assert (g270.optim.lr, g270.optim.schedule, g270.model.compute_dtype, g270.eval.every) == (
        2e-5, "cosine", "bfloat16", 200)
    dolly = load_config("gemma3-1b-lora-dolly")  # seed 000
    assert (dolly.model.lora.rank, dolly.model.lora.alpha, dolly.model.lora.targets) == (8, 16, ["q", "k", "v", "o"])
    assert (dolly.optim.name, dolly.optim.lr, dolly.optim.warmup_steps, dolly.optim.schedule) == (
        "adamw", 1e-4, 50, "cosine")
    assert (dolly.optim.weight_decay, dolly.optim.grad_clip, dolly.data.seq_len) == (0.01, 1.0, 512)
    full = load_config("gemma3-1b-full-adafactor")
    assert (full.optim.name, full.model.remat, full.model.lora.rank) == ("adafactor", "full", 0)
    for name in ("qwen-lora", "llama-lora"):
        assert load_config(name).model.lora.rank > 0


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


def test_identity_diff_reads_an_older_checkpoint_config():
    """A checkpoint written before a key existed (objective) or while the native model section still held the
    torchax keys resumes: missing keys count as their default, removed keys are not compared; a changed
    free-form mapping (data.fields) still counts."""
    cur = load_config(None, ["data.format=messages"]).to_dict()
    old = {**cur, "model": {**cur["model"], "hf_config": None, "trust_remote_code": False}}
    del old["objective"]
    assert identity_diff(old, cur) == []
    renamed = {**cur, "data": {**cur["data"], "fields": {"messages": "turns"}}}
    assert identity_diff(renamed, cur) == ["data.fields: checkpoint has {'messages': 'turns'}, config has {}"]


def test_grpo_old_logps_follow_the_compute_dtype_and_importance_sampling():
    """GRPO's old log-probs (num_iterations > 1) come from the sampler where it agrees with the trainer to float
    rounding (float32 compute), from a trainer forward in bfloat16 or when importance sampling needs both; the
    choice is recorded; importance sampling with the sampler's as the old ones is refused (every ratio would be 1)."""
    grpo = ["objective.name=grpo", "data.format=prompts", "objective.rewards=[{name: exact_number}]",
            "objective.num_iterations=2"]
    assert load_config(None, grpo).objective.old_logps == "sampler"
    assert load_config(None, [*grpo, "model.compute_dtype=bfloat16"]).objective.old_logps == "trainer"
    assert load_config(None, [*grpo, "objective.importance_sampling=token_truncate"]).objective.old_logps == "trainer"
    assert load_config(None, [*grpo, "objective.old_logps=trainer"]).to_dict()["objective"]["old_logps"] == "trainer"
    assert "old_logps" not in load_config(None, ["objective.name=dpo", "data.format=preference"]).to_dict()["objective"]
    with pytest.raises(ConfigError, match="needs objective.old_logps=trainer"):
        load_config(None, [*grpo, "objective.importance_sampling=sequence_mask", "objective.old_logps=sampler"])
    with pytest.raises(ConfigError, match="importance_sampling_min=2.0 is above"):
        load_config(None, [*grpo, "objective.importance_sampling_min=2", "objective.importance_sampling_max=1"])


def test_grpo_reward_handling_keys_take_trls_values_and_refuse_what_would_be_dropped():
    """scale_rewards group | batch | none (TRL's true/false read as group/none), multi_objective_aggregation, and
    mask_truncated_completions (GRPO and RLOO); TRL's reward_weights list is one line pointing at each reward's own
    weight, and scale_rewards beside GDPO's aggregation (which ignores it in TRL) is refused, not dropped."""
    grpo = ["objective.name=grpo", "data.format=prompts", "objective.rewards=[{name: exact_number}]"]
    objective = lambda *extra: load_config(None, [*grpo, *extra]).objective
    assert objective().scale_rewards == "group" and objective().multi_objective_aggregation == "sum_then_normalize"
    assert [objective(f"objective.scale_rewards={v}").scale_rewards for v in ("true", "false", "batch", "none")] == \
        ["group", "none", "batch", "none"]
    assert objective("objective.mask_truncated_completions=true").mask_truncated_completions
    rloo = ["objective.name=rloo", *grpo[1:], "objective.mask_truncated_completions=true"]
    assert load_config(None, rloo).objective.mask_truncated_completions
    with pytest.raises(ConfigError, match="reward_weights is TRL's list .* its own weight"):
        objective("objective.reward_weights=[1.0]")
    with pytest.raises(ConfigError, match="scale_rewards=none does not apply with multi_objective_aggregation="):
        objective("objective.multi_objective_aggregation=normalize_then_sum", "objective.scale_rewards=none")
    with pytest.raises(ConfigError, match="multi_objective_aggregation does not apply to objective.name=rloo"):
        load_config(None, [*rloo, "objective.multi_objective_aggregation=normalize_then_sum"])


def test_sync_ref_model_applies_where_a_reference_copy_can_be_mixed():
    """TR-DPO's keys at TRL 1.16's defaults on every objective with a reference model (dpo, kto, grpo, rloo); refused,
    one line naming the keys, where there is no copy to mix (LoRA's base, precomputed log-probs, grpo with beta 0)
    or no reference at all (the key does not apply); and a run resumed with sync turned on is another run."""
    kinds = {"dpo": ["data.format=preference"], "kto": ["data.format=unpaired"],
             "grpo": ["data.format=prompts", "objective.beta=0.04", "objective.rewards=[{name: exact_number}]"],
             "rloo": ["data.format=prompts", "objective.rewards=[{name: exact_number}]"]}
    for name, rest in kinds.items():
        obj = load_config(None, [f"objective.name={name}", *rest]).objective
        assert (obj.sync_ref_model, obj.ref_model_mixup_alpha, obj.ref_model_sync_steps) == (False, 0.6, 512), name
        assert not obj.syncs_reference
        synced = load_config(None, [f"objective.name={name}", *rest, "objective.sync_ref_model=true"]).objective
        assert synced.syncs_reference, name
    dpo = ["objective.name=dpo", "data.format=preference", "objective.sync_ref_model=true"]
    with pytest.raises(ConfigError, match=r"objective.sync_ref_model=true mixes the policy into a reference copy of "
                                          r"its own, and with model.lora.rank=4 the reference is the base with the "
                                          r"adapters off \(no copy\); set sync_ref_model=false, or model.lora.rank=0"):
        load_config(None, [*dpo, "model.lora.rank=4"])
    for name in ("dpo", "kto"):
        with pytest.raises(ConfigError, match=r"sync_ref_model=true changes the reference model during training, so "
                                              r"log-probs computed once before it \(objective.precompute_ref_logps="
                                              r"true\) would be stale; set one of them false"):
            load_config(None, [f"objective.name={name}", *kinds[name], "objective.sync_ref_model=true",
                               "objective.precompute_ref_logps=true"])
    with pytest.raises(ConfigError, match=r"sync_ref_model=true mixes the policy into the reference model, and grpo "
                                          r"with objective.beta=0 holds none; set objective.beta > 0"):
        load_config(None, ["objective.name=grpo", "data.format=prompts", "objective.rewards=[{name: exact_number}]",
                           "objective.sync_ref_model=true"])
    free = {"simpo": ["data.format=preference"], "gkd": ["data.format=prompts", "objective.teacher=some/model"],
            "cross_entropy": ["data.format=messages"]}
    for name, rest in free.items():
        for value in ("true", "false"):  # false, its default, is refused too: it does not apply
            with pytest.raises(ConfigError, match=f"objective.sync_ref_model does not apply to objective.name={name}"):
                load_config(None, [f"objective.name={name}", *rest, f"objective.sync_ref_model={value}"])
        assert not load_config(None, [f"objective.name={name}", *rest]).objective.syncs_reference
    for bad in ("objective.ref_model_mixup_alpha=0", "objective.ref_model_mixup_alpha=1.5",
                "objective.ref_model_sync_steps=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [*dpo, bad])
    before = load_config(None, dpo[:2]).to_dict()
    del before["objective"]["sync_ref_model"]  # a checkpoint's config from before the key: it counts as false
    assert identity_diff(before, load_config(None, dpo[:2]).to_dict()) == []
    assert identity_diff(before, load_config(None, dpo).to_dict()) == \
        ["objective.sync_ref_model: checkpoint has False, config has True"]


def test_a_grpo_step_is_counted_in_prompts_by_name():
    """GRPO's batch is objective.prompts_per_step (prompts, each sampled num_generations times), which sets and is
    recorded as train.batch_size; train.batch_size alone is refused as ambiguous (TRL counts completions) with the
    key to use, and the two disagreeing are refused; other objectives keep train.batch_size."""
    grpo = ["objective.name=grpo", "data.format=prompts", "objective.rewards=[{name: exact_number}]"]
    cfg = load_config(None, [*grpo, "objective.prompts_per_step=3"])
    assert cfg.train.batch_size == 3 and cfg.to_dict()["objective"]["prompts_per_step"] == 3
    assert load_config(None, grpo).objective.prompts_per_step == Config().train.batch_size
    with pytest.raises(ConfigError, match=r"train.batch_size=4 is ambiguous for objective.name=grpo .* set "
                                          r"objective.prompts_per_step=4 instead \(4 prompts x 8 completions"):
        load_config(None, [*grpo, "train.batch_size=4"])
    with pytest.raises(ConfigError, match="prompts_per_step=3 and train.batch_size=4 disagree"):
        load_config(None, [*grpo, "objective.prompts_per_step=3", "train.batch_size=4"])
    assert load_config(None, [*grpo, "objective.prompts_per_step=3", "train.batch_size=3"]).train.batch_size == 3
    dumped = load_config(None, [*grpo, "objective.prompts_per_step=3"]).to_dict()  # a run's config.yaml: both keys
    assert Config(**dumped).train.batch_size == 3


def test_max_prompt_length_applies_to_prompts_apart_and_bounds_grpos_prompts():
    grpo = ["objective.name=grpo", "data.format=prompts", "objective.prompts_per_step=2",
            "objective.rewards=[{name: exact_number, field: answer}]", "data.seq_len=256",
            "objective.max_completion_length=64"]
    assert load_config(None, grpo).max_prompt_tokens == 192
    assert load_config(None, [*grpo, "data.max_prompt_length=100"]).max_prompt_tokens == 100
    assert load_config(None, [*grpo, "data.max_prompt_length=500"]).max_prompt_tokens == 192
    assert load_config(None, ["objective.name=dpo", "data.format=preference",
                              "data.max_prompt_length=64"]).data.max_prompt_length == 64
    with pytest.raises(ConfigError, match=r"data.max_prompt_length applies to data.format=preference, unpaired, "
                                          r"prompts .*not messages"):
        load_config(None, ["data.format=messages", "data.max_prompt_length=64"])


def test_null_on_a_key_that_takes_none_unsets_it_and_keeps_none_where_it_means_something():
    """key=null takes back a value the config file set (the default applies, and it counts as unset), so a GRPO run
    can start from a config that sets train.batch_size; a key whose null means something keeps it."""
    default = Config().train.batch_size
    cfg = load_config("quickstart", ["train.batch_size=null"])
    assert cfg.train.batch_size == default and "batch_size" not in cfg.train.model_fields_set
    grpo = load_config("quickstart", ["objective.name=grpo", "data.format=prompts", "train.batch_size=null",
                                      "objective.prompts_per_step=3", "data.seq_len=256",
                                      "objective.rewards=[{name: exact_number, field: answer}]"])
    assert (grpo.train.batch_size, grpo.objective.prompts_per_step) == (3, 3)
    kept = load_config(None, ["objective.name=grpo", "data.format=prompts", "objective.importance_sampling_max=null",
                              "objective.rewards=[{name: exact_number, field: answer}]"])
    assert kept.objective.importance_sampling_max is None  # no upper bound, not the default 3.0


# Resolved configs as the single objective section (one class holding every objective's keys) wrote them: each
# shipped config, and each objective with its keys set (`saved_configs/`), with what each objective resolved to
# (`saved_configs_resolved.yaml`).
FIXTURES = Path(__file__).parent / "fixtures"
SAVED = sorted((FIXTURES / "saved_configs").glob("*.yaml"))
RESOLVED = yaml.safe_load((FIXTURES / "saved_configs_resolved.yaml").read_text())


# keys outside the objective added after the fixtures, with their defaults
ADDED_SINCE = {"train.compile_ahead": 32, "mesh.context": 1, "mesh.rollout": 0, "train.draw": "cdf",
               "model.formulation": 2, "optim.formulation": 1, "data.tools": None}


def as_run_config(path: Path, tmp_path: Path) -> Path:
    """``path`` copied to a run directory's config.yaml, beside its checkpoints/, as the loop saves it."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(path.read_text())
    return run / "config.yaml"


@pytest.mark.parametrize("path", SAVED, ids=lambda p: p.stem)
def test_a_config_saved_with_every_objective_key_loads_and_resumes_unchanged(path, tmp_path):
    """A run's saved config listing all 29 objective keys (those that do not apply at their unset values) loads:
    those keys are dropped, every other value is the saved one (an unset beta or loss_type, or a key added since: the
    objective's default), the objective resolves as before, and resuming its checkpoint sees no identity change. The
    same file outside a run directory is a user's config, and those keys are refused there."""
    saved = yaml.safe_load(path.read_text())
    cfg = load_config(as_run_config(path, tmp_path))
    if set(saved["objective"]) - set(type(cfg.objective).model_fields):
        with pytest.raises(ConfigError, match=f"does not apply to objective.name={cfg.objective.name}: drop it"):
            load_config(path)
    now = cfg.to_dict()
    assert identity_diff(saved, now) == []
    for key, default in ADDED_SINCE.items():  # keys added to other sections since the fixtures were saved
        section, name = key.split(".")
        assert name not in saved[section] and now[section].pop(name, default) == default  # (a torchax model: none)
    assert {k: v for k, v in now.items() if k != "objective"} == {k: v for k, v in saved.items() if k != "objective"}
    assert set(now["objective"]) == {"name", *type(cfg.objective).own_keys()}
    unset = {k for k, v in saved["objective"].items() if v is None}
    added = set(now["objective"]) - set(saved["objective"])  # keys added since the fixture was saved: their defaults
    fields = type(cfg.objective).model_fields
    assert {k: now["objective"][k] for k in added} == {k: fields[k].get_default() for k in added}
    respelled = lambda k, v: RESPELLED.get(f"objective.{k}", {}).get(v, v) if isinstance(v, bool) else v
    assert {k: v for k, v in now["objective"].items() if k not in unset | added} == \
        {k: respelled(k, saved["objective"][k]) for k in now["objective"] if k not in unset | added}
    o, was = cfg.objective, RESOLVED[path.stem]
    assert (o.beta_value, o.loss_type_value, [list(t) for t in o.weighted_loss_types], o.uses_reference, o.passes,
            o.generates) == (was["beta_value"], was["loss_type_value"], was["weighted_loss_types"],
                             was["uses_reference"], was["passes"], was["generates"])
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()  # the new dump round-trips


def test_a_key_of_another_objective_is_refused_whatever_its_value(tmp_path):
    """Another objective's key is refused at any value, its default too, naming the key, the objectives that take it
    and this objective's keys; only a run's saved config (beside its checkpoints/) drops one at its unset value, and
    refuses it at any other. A misspelt key is unknown, with a did-you-mean among this objective's keys."""
    dpo_keys = FIXTURES / "saved_configs" / "dpo-keys.yaml"
    saved = yaml.safe_load(dpo_keys.read_text())
    saved["objective"]["lmbda"] = 0.5
    refused = (r"objective: objective.lmbda does not apply to objective.name=dpo: drop it, or choose an objective "
               r"that takes it \(gkd\); dpo's keys: beta, discopop_tau, label_smoothing, loss_type, loss_weights, "
               r"precompute_ref_logps, ref_model_mixup_alpha, ref_model_sync_steps, sync_ref_model$")
    with pytest.raises(ConfigError, match=refused):  # at gkd's default
        config_from_dict({"data": {"format": "preference"}, "objective": {"name": "dpo", "lmbda": 1.0}})
    run_config = as_run_config(dpo_keys, tmp_path)
    run_config.write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match=refused):
        load_config(run_config)
    with pytest.raises(ConfigError, match=r"objective.teacher does not apply to objective.name=cross_entropy: drop "
                                          r"it, or choose an objective that takes it \(gkd\)$"):
        load_config(None, ["objective.teacher=some/model"])
    with pytest.raises(ConfigError, match=r"objective.gama: unknown key; did you mean objective.gamma\?"):
        load_config(None, ["objective.name=simpo", "data.format=preference", "objective.gama=1"])
    with pytest.raises(ConfigError, match=r"objective.name: objective.name must be one of .*'gkd'\] \(got 'ppo'\)"):
        load_config(None, ["objective.name=ppo"])
    for key in ("objective.lmbda=1.0", "objective.num_generations=8"):  # at gkd's and grpo's defaults
        with pytest.raises(ConfigError, match=f"{key.split('=')[0]} does not apply to objective.name=dpo: drop it"):
            load_config(None, ["objective.name=dpo", "data.format=preference", key])
    assert load_config(None, ["objective.name=dpo", "data.format=preference"]).to_dict()["objective"] == \
        {"name": "dpo", "beta": 0.1, "label_smoothing": 0.0, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6,
         "ref_model_sync_steps": 512, "precompute_ref_logps": False, "loss_type": "sigmoid", "loss_weights": None,
         "discopop_tau": 0.05}


@pytest.mark.parametrize("name", list(OBJECTIVE_SECTIONS))
def test_every_key_of_another_objective_is_refused_at_its_default_too(name):
    """Each objective key that does not apply to ``name`` (every other objective's, from `OBJECTIVE_SECTIONS`), set
    at the default of each objective that takes it, is refused in one line naming the key, the objective and what to
    do: a set key that this objective would ignore does not vanish from the run's config."""
    cls = OBJECTIVE_SECTIONS[name]
    spec = cls.record()
    needed = {**({"rewards": [{"name": "exact_number"}]} if spec.needs_rewards else {}),
              **({"teacher": "some/model"} if spec.companion == "teacher" else {})}
    own = {"name": name, **needed}
    assert config_from_dict({"data": {"format": spec.kinds[0].formats[0]}, "objective": own}).objective.name == name
    refused = 0
    for key in sorted({k for c in OBJECTIVE_SECTIONS.values() for k in c.own_keys()} - set(cls.model_fields)):
        owners = [n for n, c in OBJECTIVE_SECTIONS.items() if key in c.model_fields]
        for default in {repr(d): d for d in (OBJECTIVE_SECTIONS[n].model_fields[key].get_default(
                call_default_factory=True) for n in owners)}.values():
            raw = {"data": {"format": spec.kinds[0].formats[0]}, "objective": {**own, key: default}}
            with pytest.raises(ConfigError) as e:
                config_from_dict(raw)
            assert str(e.value) == (f"invalid config (<dict>): objective: objective.{key} does not apply to "
                                    f"objective.name={name}: drop it, or choose an objective that takes it "
                                    f"({', '.join(owners)})" + (f"; {name}'s keys: {', '.join(sorted(cls.own_keys()))}"
                                                                if cls.own_keys() else "")), (key, default)
            refused += 1
    assert refused >= len(set().union(*(c.own_keys() for c in OBJECTIVE_SECTIONS.values())) - set(cls.model_fields))


@pytest.mark.parametrize("name", list(OBJECTIVE_SECTIONS))
def test_each_objective_section_holds_its_own_keys_and_defaults(name):
    """``objective.name`` picks the objective's class (cross_entropy without one); its defaults are its own; the
    objective is copied with model_copy and round-trips through to_dict."""
    rewards = [{"name": "exact_number"}] if OBJECTIVE_SECTIONS[name].record().needs_rewards else []
    obj = objective_config(name=name, **({"rewards": rewards} if rewards else {}))
    assert type(obj) is OBJECTIVE_SECTIONS[name] and obj.spec.name == name
    assert objective_config().name == Config().objective.name == "cross_entropy"
    fmt = next(iter(obj.kinds)).formats[0]
    extra = {"teacher": "some/model"} if obj.spec.companion == "teacher" else {}
    cfg = config_from_dict({"data": {"format": fmt}, "objective": {"name": name, **extra,
                                                                   **({"rewards": rewards} if rewards else {})}})
    assert config_from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    if "beta" in obj.own_keys():
        copied = cfg.model_copy(update={"objective": cfg.objective.model_copy(update={"beta": 0.25})})
        assert copied.objective.beta_value == 0.25 and copied.objective.name == name
