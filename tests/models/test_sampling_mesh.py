"""The sampler under every mesh layout the trainer supports (issue 32): one process with 8 CPU devices, a tiny Llama
(with LoRA under the layouts that shard its weights, the full model under data parallelism), its weights sharded as
in training over data, fsdp and tensor. Greedy and seeded sampled
completions (one compiled generation each) equal the single-device ones token for token, and the log-probs agree to
float32 rounding (sharded contractions add partial sums in another order: a few ulp). With a context axis
(data 2 x context 4) the prompts' prefill is split along the sequence and the KV cache's slots are split too, each
decoding step's softmax reduced across the devices that hold them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config

assert jax.device_count() == 8, jax.devices()
MODEL = ["model.family=llama", "model.preset=tiny", "model.n_layer=1", "model.d_model=64", "model.n_head=4",
         "model.n_kv_head=2", "model.d_ff=128", "model.vocab_size=256", "model.max_seq_len=64"]
rng = np.random.default_rng(0)
prompts = [rng.integers(1, 256, n).tolist() for n in (3, 7, 12, 5, 9, 4, 11, 6)]
out = {}
# The sharded layouts run with LoRA (its base weights sharded as full fine-tuning's, the adapters beside them); data
# parallelism (8x1x1) replicates the weights, so it runs the full model
for lora in (False, True):
    for shape in [(1, 1, 1, 1)] + ([(1, 8, 1, 1), (2, 2, 2, 1), (2, 1, 1, 4)] if lora else [(8, 1, 1, 1)]):
        cfg = load_config(None, MODEL + (["model.lora.rank=4"] if lora else []))
        devices = jax.devices()[:int(np.prod(shape))]
        mesh = sharding.make_mesh(*shape[:3], devices, context=shape[3])
        spec = make_state_spec(cfg, 256, mesh)
        params, frozen = spec.init(0).params, spec.load_frozen(0)
        if lora:  # B != 0 (host values, placed as the params are), so the adapters change the tokens
            moved = np.random.default_rng(1)
            params = jax.tree.map(lambda x: jax.device_put(np.asarray(x) + 0.3 * moved.standard_normal(x.shape)
                                                           .astype(np.float32), x.sharding), params)
        sharded = any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves((params, frozen)))
        gen = spec.generator()
        with sharding.use_mesh(mesh):
            greedy = gen(spec.weights(params, frozen), prompts, max_new_tokens=8).ids
            sampled = gen(spec.weights(params, frozen), prompts, max_new_tokens=8, temperature=1.0, seed=3)
        out[f"{'lora' if lora else 'full'}-{'x'.join(map(str, shape))}"] = {
            "greedy": greedy, "sampled": sampled.ids, "logps": sampled.logps, "sharded": sharded,
            "compiles": gen.compiles}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_greedy_and_sampled_completions_equal_one_devices_under_every_layout(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for kind in ("full", "lora"):
        one = out[f"{kind}-1x1x1x1"]
        assert one["greedy"] != out["full-1x1x1x1"]["greedy"] or kind == "full"  # LoRA's adapters count
        for key, got in out.items():
            if not key.startswith(kind) or key.endswith("-1x1x1x1"):
                continue
            assert got["sharded"] == (not key.endswith("8x1x1x1")), key  # data parallelism replicates the weights
            assert got["compiles"] == 2, (key, got["compiles"])  # one program per (greedy, sampled) shape
            assert got["greedy"] == one["greedy"], key
            assert got["sampled"] == one["sampled"], key
            for a, b in zip(got["logps"], one["logps"], strict=True):
                assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5, key
