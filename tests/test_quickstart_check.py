"""benchmarks/quickstart_check.py, which CI runs after the suite: every shipped quickstart recipe has a check, and
each check's commands are what its recipe's header says, ending in training the recipe itself (a header that drifts
or a new recipe without a check fails here, before CI spends its minutes on the chains)."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

from jaxtune.config import SHIPPED_CONFIGS, load_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quickstart_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("quickstart_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_quickstart_recipe_is_checked_and_its_header_ends_in_training_it():
    check = _module()
    quickstarts = {p.stem for p in SHIPPED_CONFIGS.glob("*.yaml") if p.stem.endswith("quickstart")}
    assert quickstarts == set(check.CHECKS), quickstarts ^ set(check.CHECKS)
    for recipe in check.CHECKS:
        commands = check.header_commands(recipe)
        assert commands[-1][:3] == ["jaxtune", "train", recipe], (recipe, commands)
        # the check reads the recipe's own run_dir (not runs/<recipe>): the last command must write there
        assert load_config(recipe, commands[-1][3:]).run_dir == load_config(recipe).run_dir, recipe
        for cmd in commands:
            assert cmd[1] in ("train", "export"), (recipe, shlex.join(cmd))
            if cmd[1] == "train":  # each train command's overrides load (a typo in a header fails here)
                load_config(cmd[2], cmd[3:])
