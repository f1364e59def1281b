"""What a checkpoint *is*: the keys that may not change on resume (`IDENTITY_KEYS`), those that may
(`RESUMABLE_KEYS`), and the difference between a checkpoint's config and the current one (`identity_diff`)."""

from __future__ import annotations

from typing import Any

from jaxtune.config.base import takes_null
from jaxtune.config.model import STRUCTURAL
from jaxtune.config.objectives import OBJECTIVE_SECTIONS, CrossEntropyConfig
from jaxtune.config.root import Config

# What a checkpoint *is*: resuming with one of these keys changed is refused (`identity_diff`). Each changes the math of
# a step (the model, its dtypes and adapters, the tokens, the optimizer, the objective, the seed and the batch, whose
# micro-batch index feeds the dropout keys), which data is trained on or in which order, or the layout of what the
# checkpoint holds (model.scan_layers stacks the layers' params; data.num_workers shapes the saved data position).
# A section's name stands for every key in it.
IDENTITY_KEYS = (
    "model.backend", "model.from_hf", "model.hf_config", "model.family", "model.preset",
    *(f"model.{k}" for k in STRUCTURAL), "model.max_seq_len", "model.dropout", "model.param_dtype",
    "model.compute_dtype", "model.scan_layers", "model.lora", "model.quantize",
    "data.sources", "data.format", "data.text_field", "data.fields", "data.roles", "data.chat_template", "data.tools",
    "data.loss_on",
    "data.overlong", "data.packing", "data.val_sources", "data.val_fraction", "data.hf_split", "data.hf_config",
    "data.max_bytes", "data.seq_len", "data.max_prompt_length", "data.unpair", "data.num_workers",
    "tokenizer", "optim", "objective",
    "train.seed", "train.batch_size", "train.micro_batches",
)
# Free to change on resume: names and places (the data cache included), how a step is computed with the same math
# (remat, attention kernel, the products' formulation, loss chunks, length buckets and shared prompts: the same
# tokens at the same positions, only padding or a repeated prompt cut), how the sampler draws (train.draw: the same
# distribution), how long (train.steps: a longer run continues; with optim.decay_steps unset the schedule follows the
# new length), what happens on a bad row or a NaN (data.bad_rows: a run that got this far had none or dropped them;
# raise stops before training), how many processes tokenize (data.num_proc: the tokens are identical for any count)
# and what token files are checked against (data.token_*: they change no id), and how often to evaluate, save and log.
RESUMABLE_KEYS = (
    "name", "run_dir", "model.remat", "model.attention", "model.formulation", "model.trust_remote_code",
    "data.cache_dir", "data.bad_rows",
    "data.length_buckets", "data.share_prompts",
    "data.num_proc", "data.token_vocab_size", "data.token_eos_id",
    "train.steps", "train.on_nan", "train.max_nan_skips", "train.compile_cache_dir", "train.compile_ahead",
    "train.loss_chunk", "train.draw",
    "train.profile_steps",
    "eval", "checkpoint", "mesh", "distributed", "logging",
)


# Values a later version spells otherwise for the same run (a saved config keeps the old spelling): TRL's former
# boolean objective.scale_rewards.
RESPELLED = {"objective.scale_rewards": {True: "group", False: "none"}}


def is_identity_key(key: str) -> bool:
    """Whether the dotted ``key`` (``model.lora.rank``) is one of `IDENTITY_KEYS` or a key inside one."""
    return any(key == k or key.startswith(k + ".") for k in IDENTITY_KEYS)


def identity_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys of `IDENTITY_KEYS` whose values differ between a checkpoint's config and the current one. A key
    the checkpoint's config lacks (added to jaxtune since it was written) counts as that key's default; a key the
    current config lacks (removed since, or another objective's) is not compared."""
    a, b, defaults = _flatten(saved), _flatten(current), _flatten(Config().to_dict())
    for flat in (a, b):
        _objective_defaults(flat)
        for key, spelling in RESPELLED.items():
            if isinstance(flat.get(key), bool):
                flat[key] = spelling[flat[key]]
        if flat.get("objective.name") == "grpo":  # keys added later, as runs before them behaved: the trainer's old
            # log-probs, and prompts_per_step the batch size (itself an identity key)
            flat["objective.old_logps"] = flat.get("objective.old_logps") or "trainer"
            flat["objective.prompts_per_step"] = flat.get("objective.prompts_per_step") or flat.get("train.batch_size")
    old = {k: a.get(k, defaults.get(k)) for k in b}
    return [f"{k}: checkpoint has {old[k]!r}, config has {b[k]!r}" for k in sorted(b)
            if is_identity_key(k) and old[k] != b[k]]


def _objective_defaults(flat: dict[str, Any]) -> None:
    """Fills in ``flat``'s objective keys that are absent, or null where the key takes no null (a key unset), with
    the objective's defaults (`jaxtune.config.objectives`): what the config would resolve them to."""
    section = OBJECTIVE_SECTIONS.get(flat.setdefault("objective.name", CrossEntropyConfig.record().name))
    for name, field in section.model_fields.items() if section is not None else ():
        key = f"objective.{name}"
        if key not in flat or (flat[key] is None and not takes_null(field)):
            flat[key] = field.get_default(call_default_factory=True)


# Config fields holding free-form mappings: compared whole, not as sections.
_MAPPINGS = ("fields", "roles")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in _MAPPINGS:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
