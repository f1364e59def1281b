"""Every native family trains through the same loop from its preset, and reports its size."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxtune.info import info
from jaxtune.loop import train
from jaxtune.models import FAMILIES, model_config
from jaxtune.models.registry import model_layout


@pytest.mark.parametrize("family,extra", [
    ("llama", []),
    ("gemma3", ["model.scan_layers=true", "model.remat=full", "train.loss_chunk=8"]),
])
def test_family_trains_from_preset(tiny_cfg, family, extra):
    """A few steps of the full loop (checkpoint, eval, samples) on a decoder family; the loss goes down."""
    cfg = tiny_cfg(f"model.family={family}", "train.steps=12", "checkpoint.every=12", "eval.prompts=[def ]",
                   "eval.max_new_tokens=4", *extra)
    result = train(cfg)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3])
    assert result.step_compiles == 1 and result.samples


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_num_params_matches_the_model(tiny_cfg, family):
    """`num_params` (used by info and MFU) equals the parameters the module really creates."""
    cfg = tiny_cfg(f"model.family={family}")
    _, (abstract,), _ = model_layout(model_config(cfg.model, 512), None)
    assert info(cfg, vocab_size=512)["params"] == sum(math.prod(a.shape) for a in jax.tree.leaves(abstract))
