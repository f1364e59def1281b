"""A run loaded back from disk (`load_run`): a run directory, a HuggingFace model directory (or a ``.gguf`` file or
a wheel), or a config, as its config, tokenizer, model spec and latest checkpoint's params on a mesh (`LoadedRun`),
for the verbs that use a trained model (`jaxtune eval`, `generate`, `export`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxtune import sharding
from jaxtune.backends import backend_for_checkpoint, make_state_spec
from jaxtune.config import Config, ConfigError, load_config
from jaxtune.data import Tokenizer, load_tokenizer, load_tokenizer_dir
from jaxtune.job.checkpoint import Checkpointer
from jaxtune.models.gguf import is_gguf
from jaxtune.models.hf import checkpoint_tokenizer, read_config_json, resolve_hf_dir
from jaxtune.models.hf_fields import is_classifier
from jaxtune.models.wheels import is_wheel_ref
from jaxtune.train.state import ModelSpec


@dataclass
class LoadedRun:
    cfg: Config
    tokenizer: Tokenizer
    spec: ModelSpec
    params: Any  # the trained params (a LoRA run's adapters)
    frozen: tuple  # (frozen base,) for LoRA, else ()
    step: int  # 0: no checkpoint, the freshly initialised model
    is_model: bool = False  # a HuggingFace model directory (an export), not a run: no training history of its own

    @property
    def chat(self) -> bool:
        """Fine-tuned on chat data (rows of examples, the kinds that bucket them, not a text stream, with a chat
        template): a prompt is a user turn, and generation ends at the template's end of turn, in `jaxtune generate`
        and in what `jaxtune export` writes."""
        return self.tokenizer.chat_template is not None and not self.is_model and self.cfg.data.kind.buckets

    @property
    def weights(self) -> Any:
        """What the model's forward and sampler take (`ModelSpec.weights`)."""
        return self.spec.weights(self.params, self.frozen)


def load_run(target: str | Path, overrides: list[str] | tuple[str, ...] = (), mesh: Mesh | None = None) -> LoadedRun:
    """A run directory (with config.yaml), a HuggingFace model directory or a config file -> its latest
    checkpoint's params on a mesh (``mesh``, default the one its config describes).

    A config whose run has no checkpoint yet gives the initial model (step 0), useful as a baseline. A model
    directory runs on the first backend that can run it (native, else torchax), with ``data.seq_len`` capped at the
    model's context unless set; a sequence classifier's (a reward model's export) as ``objective.name=reward``. A
    ``.gguf`` file: the model directory it converts to (`jaxtune.models.gguf`)."""
    cfg, tokenizer, hf_dir = run_config(target, overrides)
    run_dir = cfg.run_path
    if mesh is None:
        cfg, mesh = _mesh_here(cfg)
    spec = make_state_spec(cfg, tokenizer.vocab_size, mesh)
    if hf_dir and not any(o.startswith("data.seq_len=") for o in overrides):  # default: up to the model's context
        seq_len = min(cfg.data.seq_len, spec.model_cfg.max_seq_len)
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seq_len": seq_len})})
    step = 0
    if (run_dir / "checkpoints").is_dir():
        ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
        step = ckpt.resume_step()
        if step:
            step, state, _ = ckpt.restore(step, spec.abstract)
        ckpt.close()
        for line in ckpt.notes(0, 0):
            print(line, file=sys.stderr)
    if not step:
        state = spec.init(cfg.train.seed)
    return LoadedRun(cfg, tokenizer, spec, state.params, spec.load_frozen(cfg.train.seed), step, hf_dir)


def _mesh_here(cfg: Config) -> tuple[Config, Mesh]:
    """The run's mesh over every device here (mesh.rollout's split is training's); where its axes need devices this
    host lacks (a run trained on a slice, loaded on a laptop to export or sample), every device here taking the rows
    instead (a checkpoint restores onto any mesh), said on stderr, and the config's mesh section set to it."""
    try:
        return cfg, sharding.mesh_of(cfg.mesh, jax.devices())
    except sharding.ShardingError as e:
        here = cfg.mesh.model_copy(update={"data": -1, "fsdp": 1, "tensor": 1, "context": 1, "rollout": 0})
        print(f"{cfg.run_path}: its mesh does not fit the {jax.device_count()} device(s) here ({e}); loaded "
              f"data-parallel over them instead", file=sys.stderr)
        return cfg.model_copy(update={"mesh": here}), sharding.mesh_of(here, jax.devices())


def run_config(target: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, Tokenizer, bool]:
    """What `load_run` reads before the weights: the config of ``target``, its tokenizer, and whether it is a
    HuggingFace model directory (not a run)."""
    path = Path(target).expanduser()
    if is_wheel_ref(str(target)) or (is_gguf(path) and path.is_file()):
        path = resolve_hf_dir(path)
    hf_dir = path.is_dir() and not (path / "config.yaml").is_file() and (path / "config.json").is_file()
    if hf_dir:  # an exported (or any HuggingFace) model directory: its weights, its tokenizer, default settings
        config = read_config_json(path)
        backend = ([] if any(o.startswith("model.backend=") for o in overrides)
                   else [f"model.backend={backend_for_checkpoint(config)}"])
        scores = [] if not is_classifier(config) or any(o.startswith("objective.name=") for o in overrides) else [
            "objective.name=reward", "data.format=preference"]
        cfg = load_config(None, [f"model.from_hf={path}", f"run_dir={path}", *backend, *scores, *overrides])
    elif path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{path} is not a run directory (no config.yaml) nor a HuggingFace model (no "
                              "config.json); pass a run directory, a model directory or a config")
        cfg = load_config(path / "config.yaml", overrides)
        cfg = cfg.model_copy(update={"run_dir": str(path)})
    else:
        if not path.exists() and (len(path.parts) > 1 or path.suffix in (".yaml", ".yml")):  # a path, not a name
            raise ConfigError(f"{target}: no such run directory, model directory or config file; pass a run "
                              "directory (the run_dir a training wrote), an exported model directory or a config")
        cfg = load_config(target, overrides)
    run_dir = cfg.run_path
    tok_dir = run_dir / "tokenizer"
    tokenizer = (load_tokenizer_dir(tok_dir) if tok_dir.is_dir()
                 else load_tokenizer(checkpoint_tokenizer(cfg.tokenizer), cfg.data))
    return cfg, tokenizer, hf_dir
