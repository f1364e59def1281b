"""docs/runs.md's overview is checked against what ships (issue 71 item 7): every shipped config is in its table,
every key of every section is in its section's row (the objective's, which are many, in docs/config.md; its row
names every objective and every loss type), and every choice of a model key that takes a few (``remat``,
``quantize``, ``attention``, ``family``) is named."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from jaxtune.config import MODEL_SECTIONS, Config
from jaxtune.config.objectives import OBJECTIVE_SECTIONS

ROOT = Path(__file__).resolve().parent.parent
RUNS = (ROOT / "docs" / "runs.md").read_text(encoding="utf-8")
ROWS = {m.group(1): m.group(0) for m in re.finditer(r"^\| `?([a-z_ ]+?)`? \|.*$", RUNS, re.MULTILINE)}


def _classes(annotation) -> list[type[BaseModel]]:
    return [t for t in (annotation, *typing.get_args(annotation)) if isinstance(t, type) and issubclass(t, BaseModel)]


def _literals(annotation) -> set[str]:
    if typing.get_origin(annotation) is typing.Literal:
        return {a for a in typing.get_args(annotation) if isinstance(a, str)}
    return set().union(*(_literals(a) for a in typing.get_args(annotation))) if typing.get_args(annotation) else set()


def _keys(cls: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in cls.model_fields.items():
        nested = _classes(info.annotation)
        out |= set().union(*(_keys(c, f"{prefix}{name}.") for c in nested)) if nested else {prefix + name}
    return out


def test_every_shipped_config_is_in_the_table():
    shipped = sorted(p.stem for p in (ROOT / "src" / "jaxtune" / "configs").glob("*.yaml"))
    assert shipped and not [s for s in shipped if f"`{s}`" not in RUNS], "add them to docs/runs.md's table"


def test_every_key_of_every_section_is_in_its_row():
    missing = []
    for section, info in Config.model_fields.items():
        if section in ("name", "run_dir", "objective"):
            continue
        classes = list(MODEL_SECTIONS.values()) if section == "model" else _classes(info.annotation)
        assert classes, section
        missing += [f"{section}.{k}" for c in classes for k in sorted(_keys(c)) if f"`{k}`" not in ROWS[section]]
    assert not missing, f"docs/runs.md's sections at a glance lack {missing}"


def test_the_objective_row_names_every_objective_and_loss_type():
    row = ROWS["objective"]
    missing = [n for n in OBJECTIVE_SECTIONS if not re.search(rf"\b{n}\b", row)]
    for name, cls in OBJECTIVE_SECTIONS.items():
        if "loss_type" in cls.model_fields:
            missing += [f"{name}:{t}" for t in sorted(_literals(cls.model_fields["loss_type"].annotation))
                        if not re.search(rf"\b{t}\b", row)]
    assert not missing, f"docs/runs.md's objective row lacks {missing}"
    assert "config.md" in row  # the rest of its keys


def test_every_choice_of_the_model_keys_is_named():
    row, missing = ROWS["model"], []
    for cls in MODEL_SECTIONS.values():
        for key in ("remat", "quantize", "attention", "family"):
            if key in cls.model_fields:
                missing += [f"{key}={v}" for v in sorted(_literals(cls.model_fields[key].annotation))
                            if not re.search(rf"\b{v}\b", row)]
    assert not missing, f"docs/runs.md's model row lacks {missing}"
