"""Loading a config: a YAML file (or a shipped config's name) plus dotted ``key=value`` overrides, validated, with
errors that name the key and suggest the nearest valid one; and writing it back."""

from __future__ import annotations

import copy
import difflib
import json
import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from jaxtune.config.base import ConfigError
from jaxtune.config.model import CHECKPOINT_DECIDES, MODEL_SECTIONS, ModelSection, backend_of
from jaxtune.config.objectives import OBJECTIVE_SECTIONS, objective_of, without_unset_keys
from jaxtune.config.root import Config

log = logging.getLogger(__name__)

SHIPPED_CONFIGS = Path(__file__).parent.parent / "configs"
# Objective keys whose value is chosen for one objective (their defaults differ between objectives): dropped from the
# file when the command line switches objective.name.
OWN_MEANING = ("beta", "loss_type", "loss_weights")

def resolve_config_path(path: str | Path) -> Path:
    """A YAML path, or the bare name of a shipped config (``quickstart`` -> configs/quickstart.yaml)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    shipped = SHIPPED_CONFIGS / f"{Path(str(path)).stem}.yaml"
    if p.suffix in ("", ".yaml", ".yml") and not p.parent.name and shipped.is_file():
        return shipped
    names = sorted(x.stem for x in SHIPPED_CONFIGS.glob("*.yaml"))
    raise ConfigError(f"config file not found: {path}. Pass a YAML path or a shipped config: {', '.join(names)}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or start from defaults), apply ``a.b=value`` overrides, validate and freeze."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = resolve_config_path(path)
        source = str(p)
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark else str(p)
            raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (model:, data:, ...)")
        if is_saved_run_config(p) and "objective" in raw:
            raw["objective"] = without_unset_keys(raw["objective"])
    given = _overridden(raw, overrides)
    base = raw
    if _from_hf(given) and _from_hf(given) != _from_hf(raw):
        # A checkpoint named on the command line decides the family, the shapes and the tokenizer: the file's values
        # for those yield to it. Overrides of them still apply (and a shape override is still an error).
        base = _yield_to_checkpoint(raw)
    name, file_name = _objective_name(given), _objective_name(raw)
    dropped = []
    if name is not None and file_name is not None and name != file_name:
        # Another objective on the command line: the file's keys chosen for its own objective (DPO's beta is not
        # SimPO's, GRPO's is not RLOO's) yield to the new objective's defaults, as do keys the new one does not take;
        # the keys both share in meaning (GRPO's and RLOO's sampling, rewards, group) carry over; keys given on the
        # command line still apply.
        takes = OBJECTIVE_SECTIONS[name].own_keys() if name in OBJECTIVE_SECTIONS else ()
        kept = {k: v for k, v in raw["objective"].items() if k in takes and k not in OWN_MEANING}
        dropped = sorted(k for k in raw["objective"] if k != "name" and k not in kept)
        base = {**base, "objective": {"name": file_name, **kept}}
    if base is not raw:
        given = _overridden(base, overrides)
    dropped = [k for k in dropped if k not in given["objective"]]  # not given again on the command line
    if dropped:
        log.warning("objective.name=%s replaces %s's objective.name=%s: its objective keys %s are dropped (%s's "
                    "defaults apply; set them on the command line to keep them)", name, source, file_name,
                    ", ".join(dropped), name)
    return config_from_dict(given, source=source)


def is_saved_run_config(path: Path) -> bool:
    """Whether ``path`` is a run's own config.yaml (beside its checkpoints/), which the loop wrote and a resume reads
    again; such a file may list keys that do not apply to its objective at their unset values."""
    return path.name == "config.yaml" and (path.parent / "checkpoints").is_dir()


def _overridden(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    given = copy.deepcopy(raw)
    for item in overrides:
        _apply_override(given, item)
    return given


def _objective_name(raw: dict[str, Any]) -> Any:
    objective = raw.get("objective")
    return objective.get("name") if isinstance(objective, dict) else None


def _from_hf(raw: dict[str, Any]) -> Any:
    model = raw.get("model")
    return model.get("from_hf") if isinstance(model, dict) else None


def _yield_to_checkpoint(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without what a HuggingFace checkpoint decides: its model keys in `CHECKPOINT_DECIDES` and its tokenizer
    section."""
    out = {k: v for k, v in copy.deepcopy(raw).items() if k != "tokenizer"}
    if isinstance(out.get("model"), dict):
        out["model"] = {k: v for k, v in out["model"].items() if k not in CHECKPOINT_DECIDES}
    return out


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_explain(e, source)) from None


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError:
        node[parts[-1]] = value


def _explain(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc, section = _section_at([str(x) for x in e["loc"]])
        key = ".".join(loc)
        if e["type"] == "extra_forbidden":
            lines.append(f"  {_unknown_key(loc, section)}")
        elif e["type"] == "backend":
            lines.append(f"  {key}.backend: {e['msg']} (got {backend_of(e.get('input'))!r})")
        elif e["type"] == "objective_name":
            lines.append(f"  {key}.name: {e['msg']} (got {objective_of(e.get('input'))!r})")
        elif not loc or isinstance(e.get("input"), dict):  # a check across keys: its message names them
            lines.append(f"  {key + ': ' if key else ''}{e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    if len(lines) == 2:  # one problem: one line, which names the key and what to do
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


# The sections that are one of several classes, by the tag pydantic puts after the section's name in an error's
# location: the model's backend, the objective's name.
UNION_SECTIONS: dict[str, dict[str, type[BaseModel]]] = {"model": MODEL_SECTIONS, "objective": OBJECTIVE_SECTIONS}


def _section_at(loc: list[str]) -> tuple[list[str], type[BaseModel] | None]:
    """The key path as the user wrote it (without pydantic's tag after ``model`` or ``objective``), and the section
    class holding its last key (None past the sections)."""
    model: type[BaseModel] | None = Config
    classes = UNION_SECTIONS.get(loc[0], {}) if loc else {}
    if len(loc) > 1 and loc[1] in classes:
        model, loc = classes[loc[1]], [loc[0], *loc[2:]]
        parents = loc[1:-1]
    else:
        parents = loc[:-1]
    for part in parents:
        ann = model.model_fields[part].annotation if model is not None and part in model.model_fields else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return loc, model


def _unknown_key(loc: list[str], section: type[BaseModel] | None) -> str:
    valid = list(section.model_fields) if section is not None else []
    name = loc[-1]
    owners = [b for b, cls in MODEL_SECTIONS.items() if name in cls.model_fields] if loc[:1] == ["model"] else []
    if owners and section is not None:
        tag = section.model_fields["backend"].default
        hint = section.KEY_HINTS.get(name, section.HINT) if issubclass(section, ModelSection) else ""
        return (f"model.{name} does not apply to model.backend={tag}{f' ({hint})' if hint else ''}; "
                f"model.{name} is for model.backend={owners[0]}")
    near = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    key = ".".join(loc)
    return f"{key}: unknown key; did you mean {'.'.join(loc[:-1] + near[:1])}?" if near else \
        f"{key}: unknown key; valid keys: {', '.join(valid)}"


def dump_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_json(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)
