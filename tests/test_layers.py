"""The package's imports run one way (docs/architecture.md): foundation → models | data | job → train → backends |
rollout → run-level verbs → cli. Walks src/jaxtune with ast, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Layer of each module, by its longest matching prefix; a module may import its own layer's group or a lower layer.
LAYERS = {
    "jaxtune": 0, "jaxtune.config": 0, "jaxtune.sharding": 0, "jaxtune.io": 0, "jaxtune.runtime": 0,
    "jaxtune.models": 1, "jaxtune.data": 1, "jaxtune.job": 1,
    "jaxtune.train": 2,
    "jaxtune.backends": 3, "jaxtune.rollout": 3,
    "jaxtune.loop": 4, "jaxtune.companions": 4, "jaxtune.run": 4, "jaxtune.evaluate": 4, "jaxtune.evaluator": 4,
    "jaxtune.generate": 4,
    "jaxtune.export": 4, "jaxtune.parity": 4, "jaxtune.info": 4, "jaxtune.aot": 4, "jaxtune.tool_trial": 4,
    "jaxtune.cli": 5,
}
# Groups that share a layer but must not import each other: a model never reads data, nor data a model; a backend
# never reaches into another one (a new backend is a folder of its own plus its registry entry).
SIBLINGS = [("jaxtune.models", "jaxtune.data"), ("jaxtune.backends.native", "jaxtune.backends.torchax")]
# Third-party imports allowed inside a function: optional extras, and slow imports only some runs need.
LAZY = {"torch", "transformers", "peft", "torchax", "wandb", "libtpu", "datasets", "pyarrow", "tiktoken",
        "huggingface_hub", "matplotlib", "tensorboardX", "tqdm", "jinja2", "absl",
        "tokenizers",  # a tokenizing worker process loads only the library its tokenizer needs
        "gguf"}  # GGUF import (models/gguf.py): only when a .gguf file is given


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "jaxtune").rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _prefix(module: str, table) -> str:
    return max((p for p in table if module == p or module.startswith(p + ".")), key=len)


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module or top-level package, line, inside a function) for every import in ``module``."""
    f = MODULES[module]
    tree = ast.parse(f.read_text())
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if f.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if base.split(".")[0] == "jaxtune" else [base]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.split(".")[0] == "jaxtune" else name.split(".")[0]
            if target and target != module:
                out.append((target, node.lineno, id(node) in inside))
    return out


def _internal_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            # a package's __init__ re-exporting its own children is not a dependency of design
            if target in MODULES and not (MODULES[m].name == "__init__.py" and target.startswith(m + ".")):
                edges[m].add(target)
    return edges


def test_every_module_has_a_layer():
    assert all(_prefix(m, LAYERS) for m in MODULES)


def test_imports_only_go_down():
    wrong = []
    for m, targets in _internal_edges().items():
        for t in targets:
            lm, lt = LAYERS[_prefix(m, LAYERS)], LAYERS[_prefix(t, LAYERS)]
            same_group = _prefix(m, LAYERS) == _prefix(t, LAYERS) or lm == lt == 4
            if lt > lm or (lt == lm and not same_group):
                wrong.append(f"{m} (layer {lm}) imports {t} (layer {lt})")
            for a, b in SIBLINGS:
                if (m.startswith(a) and t.startswith(b)) or (m.startswith(b) and t.startswith(a)):
                    wrong.append(f"{m} imports its sibling {t}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = _internal_edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_function_level_imports_are_for_optional_or_slow_packages_only():
    wrong = [f"{MODULES[m].relative_to(SRC)}:{line} imports {t} inside a function"
             for m in MODULES if m != "jaxtune.cli"
             for t, line, inside in _imports(m)
             if inside and (t.startswith("jaxtune") or t not in LAZY)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("bad", [("jaxtune.models.layers", "jaxtune.train.step"),
                                 ("jaxtune.data.sft", "jaxtune.models")])
def test_the_check_catches_an_upward_import(bad, monkeypatch):
    """The layering check fails on an upward or sideways import (a check that cannot fail proves nothing)."""
    src, target = bad
    real = _imports
    monkeypatch.setitem(globals(), "_imports", lambda m: real(m) + ([(target, 1, False)] if m == src else []))
    with pytest.raises(AssertionError, match=f"{src} .*imports {target}"):
        test_imports_only_go_down()
