"""docs/config.md is the generated configuration reference (`jaxtune.config.reference`): the checked-in copy must be
what the schema renders today, and name every key of every section. The docs' relative links must lead somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from jaxtune.config import MODEL_SECTIONS, Config
from jaxtune.config.reference import render

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "config.md"
REGENERATE = "python -m jaxtune.config.reference --write docs/config.md"


def test_checked_in_reference_is_the_generated_one():
    assert REFERENCE.read_text(encoding="utf-8") == render(), \
        f"docs/config.md is not what the config schema renders now: run `{REGENERATE}` and commit it"


def test_the_command_prints_the_reference_without_importing_jax():
    code = ("import runpy, sys\n"
            "try:\n    runpy.run_module('jaxtune.config.reference', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "sys.stderr.write('JAX_MODULES=' + ','.join(m for m in sys.modules if m.split('.')[0] == 'jax'))\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == REFERENCE.read_text(encoding="utf-8"), f"run `{REGENERATE}`"
    assert proc.stderr.rstrip().endswith("JAX_MODULES="), f"the reference imports JAX: {proc.stderr[-500:]}"


def _sections(annotation) -> list[tuple[type[BaseModel], bool]]:
    """The section classes a field's annotation holds, each with whether it is a list's item."""
    out, todo = [], [(annotation, False)]
    while todo:
        tp, item = todo.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            out.append((tp, item))
            continue
        origin = typing.get_origin(tp)
        for arg in typing.get_args(tp):
            if arg is not Ellipsis and not isinstance(arg, (str, int, float, bool)) and arg is not None:
                todo.append((arg, item or origin in (list, tuple)))
    return out


def _keys(cls: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, info in cls.model_fields.items():
        key = f"{prefix}{name}"
        nested = _sections(info.annotation)
        if not nested:
            keys.add(key)
        for sub, item in nested:
            keys |= _keys(sub, f"{key}[]." if item else f"{key}.")
    return keys


def test_every_key_of_every_section_is_in_the_reference():
    keys = _keys(Config)
    for cls in MODEL_SECTIONS.values():  # each backend's model section, whether or not Config's union lists it
        keys |= _keys(cls, "model.")
    assert {"optim.lr", "model.lora.rank", "model.backend", "objective.rewards[].name"} <= keys  # the walk works
    text = REFERENCE.read_text(encoding="utf-8")
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/config.md lacks {missing}: run `{REGENERATE}`"


# [text](target) outside code; the target up to a space or ')' (a title after the space is allowed).
_LINK = re.compile(r"(?<!\!)\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (duplicates numbered -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", md.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_in_readme_and_docs_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 5
    broken = []
    for page in pages:
        text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
        for target in _LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "broken links:\n" + "\n".join(broken)
