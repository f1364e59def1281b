"""The house style that a tool can check: `ruff check` (pinned in the dev extra, configured in pyproject.toml: its
default rules and lines of at most 120 characters) is clean over the package, the tests and the benchmarks; and no
function in the package runs past 60 lines (one idea a function, read in one sitting)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jaxtune

ROOT = Path(jaxtune.__file__).parents[2]
SRC = Path(jaxtune.__file__).parent
MAX_FUNCTION_LINES = 60


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, f"ruff check found problems (fix them, or run ruff check --fix):\n{out.stdout[-6000:]}"


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_is_longer_than_60_lines():
    found = [f"{p.relative_to(SRC)}: {name} ({lines} lines)" for p in sorted(SRC.rglob("*.py"))
             for name, lines in long_functions(p.read_text())]
    assert not found, f"split these into named steps (at most {MAX_FUNCTION_LINES} lines each):\n" + "\n".join(found)


def test_the_length_check_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions("def g():\n    return 1\n") == []
