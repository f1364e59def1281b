"""``train.profile_steps``: a jax.profiler trace of the steps asked for, written on CPU, with their step time."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from jaxtune.config import ConfigError
from jaxtune.loop import train

NO_EVAL = "data.val_fraction=0"


def test_profile_steps_write_a_trace_and_log_their_step_time(tiny_cfg, capsys):
    cfg = tiny_cfg("train.steps=4", "train.profile_steps=[2, 3]", NO_EVAL, "checkpoint.every=100")
    train(cfg)
    out = capsys.readouterr().out
    profile = cfg.run_path / "profile"
    m = re.search(rf"profiled steps 2-3: ([\d.]+) ms per step .*; trace in {re.escape(str(profile))}", out)
    assert m and float(m.group(1)) > 0, out
    (xplane,) = profile.glob("plugins/profile/*/*.xplane.pb")  # TensorBoard's profile plugin and xprof read this
    assert xplane.stat().st_size > 1000
    (perfetto,) = profile.glob("plugins/profile/*/perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(perfetto.read_bytes()))
    assert events["traceEvents"]  # Perfetto's JSON: events recorded while the steps ran
    seconds = json.loads((cfg.run_path / "summary.json").read_text())["seconds"]  # where the wall time went
    assert {"setup", "compile", "steps", "save", "finish"} <= set(seconds) and seconds["steps"] > 0, seconds
    assert re.search(r"time: [\d.]+ s in train\(\): setup [\d.]+, compile .*% outside steps", out), out

    resumed = train(tiny_cfg("train.steps=6", "train.profile_steps=[2, 3]", NO_EVAL, "checkpoint.every=100"))
    assert resumed.step == 6
    assert "step 2 was run before this resume (step 4); not profiled" in capsys.readouterr().out


@pytest.mark.parametrize("steps", ["[0, 3]", "[3, 2]", "[2, 50]"])
def test_profile_steps_out_of_range_is_a_config_error(tiny_cfg, steps):
    with pytest.raises(ConfigError, match=r"train.profile_steps=.*1 <= START <= END <= train.steps \(20\)"):
        tiny_cfg(f"train.profile_steps={steps}")
