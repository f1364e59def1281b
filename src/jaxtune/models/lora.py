"""LoRA adapters out of a model: merged into the base weights, or written as a PEFT adapter directory.

The adapters themselves live in `jaxtune.models.layers.Dense` (``lora_a`` (in, r), ``lora_b`` (r, out)); a
LoRA model's params split into (adapters, frozen base) by `jaxtune.models.registry.param_groups`. PEFT stores
``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r) under the base module's HuggingFace name prefixed with
``base_model.model.``, so the names come from the family's hf_map like every other export.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.io import atomic_dir, check_out_dir, host, write_safetensors
from jaxtune.models.family import Family
from jaxtune.models.hf import match_param, write_stop_tokens
from jaxtune.models.layers import LoraSpec
from jaxtune.models.quantize import dequantize, is_quantized

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _adapter_nodes(tree: Any, path: tuple = ()):
    """(path, {"lora_a", "lora_b"}) for every adapted projection in an adapters tree."""
    if isinstance(tree, dict):
        if "lora_a" in tree:
            yield path, tree
            return
        for k, v in tree.items():
            yield from _adapter_nodes(v, (*path, k))


def _node(tree: dict, path: tuple) -> dict:
    for k in path:
        tree = tree[k]
    return tree


def lora_delta(a: jax.Array, b: jax.Array, spec: LoraSpec) -> jax.Array:
    """scale * A @ B in float32: (in, r) @ (r, out), or per layer for stacked (L, in, r) @ (L, r, out)."""
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)) * spec.scale


def _trained_weights(tree: Any, path: tuple = ()):
    """(path, node) for every module an adapters tree trains whole beside the adapters (a reward model's score
    head, PEFT's ``modules_to_save``): the nodes that hold no ``lora_a``."""
    if isinstance(tree, dict) and tree and "lora_a" not in tree:
        if not any(isinstance(v, dict) for v in tree.values()):
            yield path, tree
            return
        for k, v in tree.items():
            yield from _trained_weights(v, (*path, k))


def merge_adapters(adapters: Any, base: Any, spec: LoraSpec) -> Any:
    """The base params with each adapted kernel replaced by ``W + scale A B`` (in W's dtype), and the modules trained
    whole beside the adapters (a score head) added: the params of the same model without LoRA, which export as an
    ordinary HuggingFace checkpoint. Inputs are not modified."""
    merged = jax.tree.map(lambda x: x, base)  # a copy of the dict structure; arrays are immutable
    for path, node in _trained_weights(adapters):
        parent = _node(merged, path[:-1]) if len(path) > 1 else merged
        parent[path[-1]] = dict(node)
    for path, node in _adapter_nodes(adapters):
        target = _node(merged, path)
        w = target["kernel"]
        dtype = jnp.float32 if is_quantized(w) else w.dtype  # QLoRA: the merged kernel dequantized (float32)
        target["kernel"] = (dequantize(w, jnp.float32) + lora_delta(node["lora_a"], node["lora_b"], spec)).astype(dtype)
    return merged


@functools.partial(jax.jit, static_argnums=(2,))
def _merged_kernels(adapters: Any, kernels: tuple, spec: LoraSpec) -> tuple:
    nodes = [node for _, node in _adapter_nodes(adapters)]
    return tuple((w.astype(jnp.float32) + lora_delta(n["lora_a"], n["lora_b"], spec)).astype(w.dtype)
                 for w, n in zip(kernels, nodes))


def adapted_kernels(adapters: Any, base: Any) -> list[Any]:
    """The base's kernels that ``adapters`` adapt: the arrays `merged_weights` computes anew (arrays or abstract
    shapes alike)."""
    return [_node(base, path)["kernel"] for path, _ in _adapter_nodes(adapters)]


def merged_weights(adapters: Any, base: Any, spec: LoraSpec) -> Any:
    """`merge_adapters` on device for sampling: only the adapted kernels are computed anew (one compiled program);
    every other array is the base's own, not copied. The trained adapters are untouched."""
    paths = [path for path, _ in _adapter_nodes(adapters)]
    kernels = _merged_kernels(adapters, tuple(_node(base, p)["kernel"] for p in paths), spec)
    merged = jax.tree.map(lambda x: x, base)
    for path, kernel in zip(paths, kernels):
        _node(merged, path)["kernel"] = kernel
    return merged


def peft_tensors(fam: Family, adapters: Any) -> dict[str, np.ndarray]:
    """Adapters -> {PEFT name: float32 array}: ``base_model.model.<hf module>.lora_A.weight`` (r, in) and
    ``.lora_B.weight`` (out, r); a module trained whole (a reward model's score head: PEFT's ``modules_to_save``)
    as ``base_model.model.<hf name>``, the name PEFT saves it under."""
    out = {PEFT_PREFIX + name: x for name, x in _whole_tensors(fam, adapters).items()}
    for path, node in _adapter_nodes(adapters):
        m, layer = match_param(fam, ".".join(str(p) for p in (*path, "kernel")))
        if not (m.transpose and m.hf_ndim is None and m.hf.endswith(".weight")):
            raise ValueError(f"{fam.name}: {'.'.join(map(str, path))} is not a plain linear layer in HuggingFace; "
                             "export the merged model instead")
        a, b = np.asarray(host(node["lora_a"]), np.float32), np.asarray(host(node["lora_b"]), np.float32)
        layers = range(a.shape[0]) if layer == "stacked" else [layer]
        for i in layers:
            ai, bi = (a[i], b[i]) if layer == "stacked" else (a, b)
            name = PEFT_PREFIX + m.hf.format(i=i).removesuffix(".weight")
            out[f"{name}.lora_A.weight"] = np.ascontiguousarray(ai.T)
            out[f"{name}.lora_B.weight"] = np.ascontiguousarray(bi.T)
    return out


def _whole_tensors(fam: Family, adapters: Any) -> dict[str, np.ndarray]:
    """{HF name: float32 array} of the modules an adapters tree trains whole (a reward model's score head)."""
    out = {}
    for path, node in _trained_weights(adapters):
        for leaf, value in node.items():
            m, _ = match_param(fam, ".".join(str(p) for p in (*path, leaf)))
            x = np.asarray(host(value), np.float32)
            out[m.hf] = np.ascontiguousarray(x.T if m.transpose else x)
    return out


def peft_config(fam: Family, spec: LoraSpec, base_model: str | None, whole: Sequence[str] = ()) -> dict[str, Any]:
    """adapter_config.json for PEFT's LoraConfig: target modules by their HuggingFace names; ``whole``: the modules
    trained whole beside them (a reward model's ``score``: PEFT's SEQ_CLS task, ``modules_to_save``)."""
    hf_names = {}
    for ours in spec.targets:
        part = "self_attn" if ours in ("q", "k", "v", "o") else "mlp"
        m = fam.hf_map.get(f"layers.{{i}}.{'attn' if part == 'self_attn' else 'mlp'}.{ours}.kernel")
        if m is None:
            raise ValueError(f"{fam.name}: no HuggingFace name for LoRA target {ours}")
        hf_names[ours] = m.hf.removesuffix(".weight").rsplit(".", 1)[-1]
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if "score" in whole else "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(hf_names.values()),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": list(whole) or None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_adapter(out_dir: str | Path, fam: Family, spec: LoraSpec, adapters: Any, *, base_model: str | None = None,
                  tokenizer: Any = None, overwrite: bool = False, end_of_turn: Sequence[int] = (),
                  eos: int | None = None, pad_id: int | None = None) -> Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors [+ tokenizer]) that
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads. ``end_of_turn``: a chat model's end-of-turn token ids;
    generation settings come from the base's directory, which the adapter cannot change, so they go into a
    generation_config.json of the adapter's own (the base's EOS ``eos``, the tokenizer's, then the end of turn:
    `write_stop_tokens`) and the tokenizer's EOS. ``pad_id``: the pad token the tokenizer names
    (`jaxtune.models.hf.export_pad_id`). Written beside ``out_dir`` and renamed into place."""
    out = Path(out_dir).expanduser()
    check_out_dir(out, overwrite)
    tensors = peft_tensors(fam, adapters)
    if jax.process_index() != 0:
        return out

    def fill(tmp: Path) -> None:
        whole = sorted({name.rsplit(".", 1)[0] for name in _whole_tensors(fam, adapters)})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(fam, spec, base_model, whole), indent=2) + "\n")
        write_safetensors(tmp / ADAPTER_WEIGHTS, tensors, metadata={"format": "pt"})
        eos_id = write_stop_tokens(tmp, end_of_turn, [eos, tokenizer and tokenizer.eos_id])
        if tokenizer is not None:
            tokenizer.save(tmp, eos_id=eos_id, pad_id=pad_id)

    atomic_dir(out, fill)
    return out
