"""Sharded training on 8 simulated CPU devices gives the single-device losses; params really are sharded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import ClassVar

import jax
import pytest
from helpers.processes import beside

from jaxtune.config import load_config
from jaxtune.data import load_tokenizer, prepare_tokens
from jaxtune.loop import train
from jaxtune.sharding import ShardingError, make_mesh, param_shardings

# (data, fsdp, tensor): one layout per axis and a mixed one (a data x fsdp layout would run the mixed one's code
# path less the tensor axis).
LAYOUTS = {
    "data8": (8, 1, 1),
    "fsdp8": (1, 8, 1),
    "data2_fsdp2_tensor2": (2, 2, 2),
    "tensor8": (1, 1, 8),
}
STEPS = 6

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from jaxtune.config import load_config
    from jaxtune.job.checkpoint import Checkpointer
    from jaxtune.loop import train
    from jaxtune.sharding import make_mesh
    from jaxtune.backends import make_state_spec

    assert jax.device_count() == 8, jax.devices()
    layouts, probe, base = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    out = {}
    restored = {}
    for name, (d, f, t) in layouts.items():
        cfg = load_config(None, base + [f"run_dir={base[-1].split('=', 1)[1]}-{name}", f"mesh.data={d}",
                                        f"mesh.fsdp={f}", f"mesh.tensor={t}"])
        result = train(cfg)
        spec = make_state_spec(cfg, 512, make_mesh(d, f, t))
        ckpt = Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint)
        _, state, _ = ckpt.restore(result.step, spec.abstract)
        ckpt.close()
        restored[name] = (cfg, result.step, state)
        fc = state.params
        for k in probe:  # the first MLP input kernel: logical axes (embed, mlp)
            fc = fc[k]
        mu = state.opt_state  # adamw moments mirror the params' sharding
        out[name] = {
            "losses": {str(k): v for k, v in result.losses.items()},
            "fc_spec": str(fc.sharding.spec),
            "fc_shard_bytes": fc.addressable_shards[0].data.nbytes,
            "fc_bytes": fc.nbytes,
            "compiles": result.step_compiles,
            "opt_leaves_sharded": sum(1 for x in jax.tree.leaves(mu)
                                      if x.ndim and x.addressable_shards[0].data.nbytes < x.nbytes),
        }
    # Save under one mesh, restore under another: data=8 -> fsdp=4 x tensor=2, bitwise.
    cfg, step, state = restored["data8"]
    spec = make_state_spec(cfg, 512, make_mesh(1, 4, 2))
    ckpt = Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint)
    _, moved, _ = ckpt.restore(step, spec.abstract)
    ckpt.close()
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), state, moved)
    out["reshard"] = {"bitwise": all(jax.tree.leaves(same)),
                      "sharded": dict(jax.tree.leaves(moved.params)[-1].sharding.mesh.shape)}
    print("RESULT " + json.dumps(out))
    """
)


PROBES = {"gpt2": ["blocks", 0, "fc", "kernel"], "llama": ["layers", 0, "mlp", "gate", "kernel"]}


def _launch(layouts: dict, probe: list, base: list[str]) -> subprocess.Popen:
    """`SCRIPT` on 8 simulated devices, started in the background: the caller trains its single-device reference
    meanwhile (each compile is single-threaded, and CI has two cores). The token cache must exist already."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(layouts), json.dumps(probe), *base],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _single_device(base: list[str], run_dir) -> dict[int, float]:
    """The reference losses: the same run on one device, in this process."""
    assert jax.device_count() == 1
    return train(load_config(None, base[:-1] + [f"run_dir={run_dir}"])).losses


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_layouts_match_single_device(tmp_path, tiny_overrides, family):
    """Every layout gives the single-device losses over 6 steps (<=1e-5 rel), compiles once, really shards
    params and optimizer state; a checkpoint saved with data=8 restores with fsdp=4 x tensor=2 bitwise."""
    base = tiny_overrides + [f"train.steps={STEPS}", f"checkpoint.every={STEPS}", "model.n_head=8",
                             f"model.family={family}", f"run_dir={tmp_path / 'layout'}"]
    cfg = load_config(None, base)
    prepare_tokens(cfg.data, load_tokenizer(cfg.tokenizer, cfg.data))  # built once, before two processes read it
    ref, out = beside(_launch(LAYOUTS, PROBES[family], base), lambda: _single_device(base, tmp_path / "single"))
    assert sorted(ref) == list(range(1, STEPS + 1))
    reshard = out.pop("reshard")
    assert reshard["bitwise"] and reshard["sharded"] == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}
    for name, r in out.items():
        for step, loss in r["losses"].items():
            rel = abs(loss - ref[int(step)]) / abs(ref[int(step)])
            assert rel <= 1e-5, (name, step, loss, ref[int(step)])
        assert r["compiles"] == 1, name
    # Parameters are sharded as the rule table says: fc kernel is (embed, mlp) -> (fsdp, tensor).
    assert out["data8"]["fc_shard_bytes"] == out["data8"]["fc_bytes"]  # pure data parallel: replicated
    assert out["fsdp8"]["fc_shard_bytes"] * 8 == out["fsdp8"]["fc_bytes"]
    assert out["data2_fsdp2_tensor2"]["fc_shard_bytes"] * 4 == out["data2_fsdp2_tensor2"]["fc_bytes"]
    assert out["tensor8"]["fc_spec"] == "P('fsdp', 'tensor')"
    assert out["tensor8"]["fc_shard_bytes"] * 8 == out["tensor8"]["fc_bytes"]
    assert out["fsdp8"]["opt_leaves_sharded"] > 0 and out["data8"]["opt_leaves_sharded"] == 0


def test_mesh_that_does_not_fit_is_a_named_error():
    with pytest.raises(ShardingError, match=r"mesh\.data × mesh\.fsdp × mesh\.tensor = 2×1×1 = 2, but there are 1"):
        make_mesh(2, 1, 1)


def test_non_dividing_dimension_is_a_named_error():
    class EightWayFsdp:  # only .shape is consulted before any device placement
        shape: ClassVar[dict[str, int]] = {"data": 1, "fsdp": 8, "tensor": 1}

    abstract = {"w": jax.ShapeDtypeStruct((60, 240), "float32")}
    with pytest.raises(ShardingError,
                       match=r"\['w'\] \(60, 240\): dimension 60 does not divide mesh axis fsdp of size 8"):
        param_shardings(EightWayFsdp(), abstract, {"w": ("embed", "mlp")})


def test_lora_adapters_shard_with_their_base(tmp_path, tiny_overrides):
    """LoRA on 8 devices: A (in, r) is sharded like its base kernel's input axis and B (r, out) like its output
    axis, the frozen base exactly as without LoRA; data8 and data2 x fsdp2 x tensor2 give the single-device
    losses (<=1e-5 rel) and compile once."""
    base = tiny_overrides + [f"train.steps={STEPS}", f"checkpoint.every={STEPS}", "model.n_head=8",
                             "model.family=llama", "model.lora.rank=4", "optim.lr=1e-2",
                             f"run_dir={tmp_path / 'layout'}"]
    cfg = load_config(None, base)
    prepare_tokens(cfg.data, load_tokenizer(cfg.tokenizer, cfg.data))
    layouts = {k: LAYOUTS[k] for k in ("data8", "data2_fsdp2_tensor2")}  # data8: the script's reshard source

    def here():
        _check_lora_shardings(cfg, base)  # abstract meshes: no devices, no compiles
        return _single_device(base, tmp_path / "single")

    ref, out = beside(_launch(layouts, ["layers", 0, "mlp", "gate", "lora_a"], base), here)
    assert out.pop("reshard")["bitwise"]
    for name, r in out.items():
        for step, loss in r["losses"].items():
            assert abs(loss - ref[int(step)]) <= 1e-5 * abs(ref[int(step)]), (name, step)
        assert r["compiles"] == 1
    assert out["data2_fsdp2_tensor2"]["fc_spec"] == "P('fsdp', None)"  # (embed, lora_rank), like the kernel's embed
    assert out["data2_fsdp2_tensor2"]["fc_shard_bytes"] * 2 == out["data2_fsdp2_tensor2"]["fc_bytes"]
    assert ref[STEPS] < ref[1]  # the adapters learn


def _check_lora_shardings(cfg, base: list[str]) -> None:
    from jaxtune.backends import make_state_spec
    from jaxtune.sharding import abstract_mesh

    for mesh_shape in [(2, 2, 2), (1, 8, 1), (1, 1, 8)]:
        mesh = abstract_mesh(*mesh_shape, 8)
        spec = make_state_spec(cfg, 512, mesh)
        plain = make_state_spec(load_config(None, base + ["model.lora.rank=0"]), 512, mesh)
        (base_params,) = spec.frozen_abstract
        assert jax.tree.map(lambda a: a.sharding.spec, base_params) == jax.tree.map(
            lambda a: a.sharding.spec, plain.abstract.params)
        checked = 0
        for layer, mods in spec.abstract.params["layers"].items():
            for part in mods.values():
                for name, adapter in part.items():
                    kernel = base_params["layers"][layer][next(k for k in ("attn", "mlp") if name in
                                                               base_params["layers"][layer][k])][name]["kernel"]
                    assert adapter["lora_a"].sharding.spec[0] == kernel.sharding.spec[0], (mesh_shape, name)
                    assert adapter["lora_b"].sharding.spec[1] == kernel.sharding.spec[1], (mesh_shape, name)
                    checked += 1
        assert checked == 2 * 7  # 2 layers x q k v o gate up down

