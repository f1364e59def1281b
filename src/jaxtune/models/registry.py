"""From the run's `ModelConfig` section to a family's own config and module, and its parameter layout."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxtune import sharding
from jaxtune.config import FAMILY_NAMES
from jaxtune.models import gemma3, gpt2, llama, mistral, qwen, qwen3_moe
from jaxtune.models.decoder import DecoderConfig
from jaxtune.models.family import Family
from jaxtune.models.layers import KeyStream, LoRAParam, LoraSpec, frozen_as_shapes

# The implementation of each family `jaxtune.config.kinds.FAMILY_NAMES` declares (``model.family``'s values).
FAMILIES: dict[str, Family] = {f.name: f for f in (gpt2.FAMILY, llama.FAMILY, qwen.QWEN2, qwen.QWEN3, qwen3_moe.FAMILY,
                                                   mistral.FAMILY, gemma3.FAMILY)}
if set(FAMILIES) != set(FAMILY_NAMES):  # declared without an implementation, or implemented without its name
    raise ImportError(f"model families declared in jaxtune.config.kinds {sorted(FAMILY_NAMES)} != implemented "
                      f"{sorted(FAMILIES)}")


def build_model(cfg: Any, seed: int) -> nnx.Module:
    """The family's module, its weights drawn from ``seed`` (a scanned stack splits ``nnx.Rngs``; layers built one
    by one draw the same keys from a `KeyStream`)."""
    rngs = nnx.Rngs(params=seed) if getattr(cfg, "scan_layers", False) else KeyStream(seed)
    return FAMILIES[cfg.family].module_cls(cfg, rngs=rngs)


def param_groups(cfg: Any) -> tuple:
    """How a model's parameters split: (trainable, frozen) filters with LoRA, else all of them train."""
    return (LoRAParam, nnx.Param) if adapters(cfg) is not None else (nnx.Param,)


def adapters(cfg: Any) -> LoraSpec | None:
    """A family config's LoRA adapters: the decoder families' ``lora`` (GPT-2 has none)."""
    return cfg.lora if isinstance(cfg, DecoderConfig) else None


def model_layout(cfg: Any, mesh: Mesh | None, seed: int = 0) -> tuple[nnx.GraphDef, list[Any], list[Any] | None]:
    """(graphdef, abstract params, NamedShardings on ``mesh`` or None) without allocating anything. The params are
    a list with one pure dict of ShapeDtypeStructs per `param_groups` entry: [params], or [adapters, frozen base]
    with LoRA; ``nnx.merge(graphdef, *groups)`` rebuilds the model."""
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, seed))
    graphdef, *states = nnx.split(abstract_model, *param_groups(cfg))
    abstract = [nnx.to_pure_dict(s) for s in states]
    if mesh is None:
        return graphdef, abstract, None
    shardings = []
    for state, tree in zip(states, abstract):
        logical = nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["logical_axes"]), state,
                                                is_leaf=lambda v: isinstance(v, nnx.Variable)))
        shardings.append(sharding.param_shardings(mesh, tree, sharding.param_axes(tree, logical)))
    return graphdef, abstract, shardings


def init_params(cfg: Any, seed: int) -> list[Any]:
    """The family's initial params, split as `model_layout` splits them (call under jit to place them)."""
    _, *states = nnx.split(build_model(cfg, seed), *param_groups(cfg))
    return [nnx.to_pure_dict(s) for s in states]


def init_trained(cfg: Any, seed: int) -> Any:
    """The trained group of `init_params` (LoRA's adapters, a reward model's head), computed op by op without the
    frozen base's draws: the same values, without compiling the whole model's initialisation (with LoRA, hundreds of
    unrolled random draws: ~15 s of XLA:CPU at 135M, benchmarks/RESULTS.md). A score head's normal draw may differ
    from the compiled one in its last bit. Scanned layers draw each weight for every layer at once (`nnx.vmap`,
    which cannot hold a shape): they compile quickly and stay compiled."""
    if getattr(cfg, "scan_layers", False):
        return jax.jit(lambda: init_params(cfg, seed)[0])()
    with frozen_as_shapes():
        model = build_model(cfg, seed)
    return nnx.to_pure_dict(nnx.split(model, *param_groups(cfg))[1])


def merge(graphdef: nnx.GraphDef, weights: Any) -> nnx.Module:
    """The model from its graph and weights: one params dict, or a tuple (adapters, frozen base) with LoRA."""
    return nnx.merge(graphdef, *weights) if isinstance(weights, (tuple, list)) else nnx.merge(graphdef, weights)
