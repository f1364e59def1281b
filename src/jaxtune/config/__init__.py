"""Run configuration: YAML + dotted ``key=value`` overrides, typed, validated at load, frozen.

One section per concern (model, data, tokenizer, optim, objective, train, eval, checkpoint, mesh, distributed,
logging), each a pydantic model that forbids unknown keys. Errors name the key (``optim.lr``) and, for unknown keys,
suggest the nearest valid one. Components receive only their own section (a model gets ``ModelConfig``, never
``Config``).

One idea a file: ``kinds`` (every batch kind, objective, family and GGUF type, declared once), ``base`` (the
section base and `ConfigError`), the sections (``model``, ``data``, ``objectives``: one class per objective,
``rewards``, ``run``; ``root``: `Config`
itself and its cross-section checks), ``identity`` (what a checkpoint is: resume keys), ``load`` (YAML, overrides,
errors), ``hub`` (HuggingFace hub names). The reference of every key, `docs/config.md`, is generated from these
classes (``python -m jaxtune.config.reference``).
"""

from jaxtune.config.base import ConfigError, Section
from jaxtune.config.data import DataConfig, TokenizerConfig
from jaxtune.config.hub import HUB_TIMEOUT, HubError, local_or_hub
from jaxtune.config.identity import IDENTITY_KEYS, RESUMABLE_KEYS, identity_diff, is_identity_key
from jaxtune.config.kinds import (
    BATCH_KINDS,
    FAMILY_NAMES,
    FORMATS,
    GGUF_TYPES,
    OBJECTIVES,
    PAIRS,
    PROMPTS,
    REFERENCE_HELD_OUT,
    ROWS,
    UNPAIRED,
    WINDOWS,
    BatchKind,
    ObjectiveKind,
)
from jaxtune.config.load import (
    SHIPPED_CONFIGS,
    config_from_dict,
    config_json,
    dump_config,
    load_config,
    resolve_config_path,
)
from jaxtune.config.model import (
    CHECKPOINT_DECIDES,
    LORA_HF_NAMES,
    LORA_OUR_TO_HF,
    LORA_TARGETS,
    MODEL_SECTIONS,
    STRUCTURAL,
    LoraConfig,
    ModelConfig,
    NativeModelConfig,
    TorchaxModelConfig,
)
from jaxtune.config.objectives import OBJECTIVE_SECTIONS, ObjectiveConfig, ObjectiveSection, objective_config
from jaxtune.config.rewards import BUILTIN_REWARDS, MODEL_REWARD, RewardConfig
from jaxtune.config.root import Config
from jaxtune.config.run import (
    CheckpointConfig,
    DistributedConfig,
    EvalConfig,
    LoggingConfig,
    MeshConfig,
    OptimConfig,
    TrainConfig,
)

__all__ = [
    "BATCH_KINDS",
    "BUILTIN_REWARDS",
    "CHECKPOINT_DECIDES",
    "FAMILY_NAMES",
    "FORMATS",
    "GGUF_TYPES",
    "HUB_TIMEOUT",
    "IDENTITY_KEYS",
    "LORA_HF_NAMES",
    "LORA_OUR_TO_HF",
    "LORA_TARGETS",
    "MODEL_REWARD",
    "MODEL_SECTIONS",
    "OBJECTIVES",
    "OBJECTIVE_SECTIONS",
    "PAIRS",
    "PROMPTS",
    "REFERENCE_HELD_OUT",
    "RESUMABLE_KEYS",
    "ROWS",
    "SHIPPED_CONFIGS",
    "STRUCTURAL",
    "UNPAIRED",
    "WINDOWS",
    "BatchKind",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "HubError",
    "LoggingConfig",
    "LoraConfig",
    "MeshConfig",
    "ModelConfig",
    "NativeModelConfig",
    "ObjectiveConfig",
    "ObjectiveKind",
    "ObjectiveSection",
    "OptimConfig",
    "RewardConfig",
    "Section",
    "TokenizerConfig",
    "TorchaxModelConfig",
    "TrainConfig",
    "config_from_dict",
    "config_json",
    "dump_config",
    "identity_diff",
    "is_identity_key",
    "load_config",
    "local_or_hub",
    "objective_config",
    "resolve_config_path",
]
