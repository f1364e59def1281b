"""Comparing jaxtune with a reference: the error measure the tests' tolerances are stated in, and the logits of each
side (a jaxtune model, a PyTorch model, transformers' model read from a ``.gguf``)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np


def rel(ours, ref) -> float:
    """max|ours - ref| / max|ref| over the whole tensor, in float64: the error relative to the reference's scale."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def jax_logits(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


def torch_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids, np.int64))).logits.float().numpy()


def hf_from_gguf(path: Path, **config):
    """transformers' own GGUF loader (``gguf_file=``) on ``path``, eager attention, in eval mode; ``config``
    overrides what it reads."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             attn_implementation="eager", **config).eval()
