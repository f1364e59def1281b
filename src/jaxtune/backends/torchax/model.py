"""A HuggingFace PyTorch causal LM as a pure JAX function, through torchax.

The PyTorch model is built on the CPU with torchax off (``from_pretrained`` or ``from_config``), optionally
wrapped by PEFT for LoRA, and never moved: its parameters are copied out once as JAX arrays, and every call runs
``torch.func.functional_call`` with those arrays (viewed as torchax tensors) in place of the module's own. So
nothing is untied (``named_parameters`` lists a tied weight once, and ``functional_call`` feeds it to every
module that shares it), and the same module serves the trainer, evaluation and export.

Attention masks: batches carry ``positions``; transformers turns restarting positions into a packed-sequence
causal mask (and each layer type's window), so every query row sees at least itself and no row is fully masked,
whether the batch is packed or padded. No ``attention_mask`` is passed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util
from jax.ad_checkpoint import checkpoint_name

from jaxtune.backends.torchax.compat import import_torchax
from jaxtune.config import LORA_OUR_TO_HF, LORA_TARGETS, ConfigError, TorchaxModelConfig
from jaxtune.models.hf import read_config_json, resolve_hf_dir
from jaxtune.models.hf_fields import is_classifier
from jaxtune.models.layers import LAYER_INPUT, REMAT_POLICIES


class UnsupportedOpError(NotImplementedError):
    """torchax has no JAX lowering for an op the model uses; names the op and the module that called it."""


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"a.b.0.w": x} -> {"a": {"b": {"0": {"w": x}}}} (the pytree layout checkpoints and shardings use)."""
    return traverse_util.unflatten_dict(flat, sep=".")


def flatten(tree: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `nest`."""
    return traverse_util.flatten_dict(tree, sep=".")


def to_numpy(t: Any, dtype: str | None = None) -> np.ndarray:
    """A CPU torch tensor as numpy (bfloat16 through ml_dtypes), optionally cast."""
    import torch

    a = t.detach().cpu()
    if a.dtype == torch.bfloat16:
        arr = a.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        arr = a.numpy()
    return arr.astype(dtype) if dtype is not None and arr.dtype != np.dtype(dtype) else arr


def to_torch(a: Any) -> Any:
    """numpy/JAX array -> CPU torch tensor (bfloat16 kept)."""
    import torch

    arr = np.asarray(a)
    if arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


def _config_path(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"model.hf_config={path}: no such config.json")
    return p


def build_torch_model(cfg: TorchaxModelConfig, seed: int, head: str = "lm") -> Any:
    """The HF model on the CPU (float32, eval mode: dropout comes from the step's key, not torch's RNG), wrapped by
    PEFT when ``cfg.lora.rank`` > 0. Deterministic in ``seed`` for random init and LoRA's A matrices. ``head``:
    ``lm`` a causal LM, ``score`` a sequence classifier with one label (a reward model: a causal LM's checkpoint gets
    a fresh score head, a classifier's keeps its own; LoRA trains the head with the adapters, PEFT's SEQ_CLS task).
    A classifier's checkpoint for a language-model head is refused: its LM head would be fresh and untrained."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = {"attn_implementation": "sdpa", "trust_remote_code": cfg.trust_remote_code}
    auto = transformers.AutoModelForSequenceClassification if head == "score" else transformers.AutoModelForCausalLM
    labels = {"num_labels": 1} if head == "score" else {}
    if cfg.from_hf:
        directory = resolve_hf_dir(cfg.from_hf)
        if head == "lm" and is_classifier(read_config_json(directory)):
            raise ConfigError(f"model.from_hf={cfg.from_hf} is a reward model (a sequence classifier's score head, no "
                              "language-model head); this objective trains a language model: start from a causal LM "
                              "checkpoint")
        try:
            model = auto.from_pretrained(directory, dtype=torch.float32, use_safetensors=True, **labels, **common)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.from_hf={cfg.from_hf}: transformers cannot load it: {e}") from None
    else:
        path = _config_path(cfg.hf_config)
        try:
            hf_cfg = transformers.AutoConfig.from_pretrained(path.parent, trust_remote_code=cfg.trust_remote_code,
                                                             **labels)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.hf_config={cfg.hf_config}: {e}") from None
        model = auto.from_config(hf_cfg, dtype=torch.float32, **common)
    if head == "score" and model.config.pad_token_id is None:  # its pooling needs one; jaxtune reads every position
        model.config.pad_token_id = 0
    model.eval()
    if cfg.lora.rank:
        model = _with_lora(model, cfg, "SEQ_CLS" if head == "score" else "CAUSAL_LM")
    return model


def lora_targets(cfg: TorchaxModelConfig) -> str | list[str]:
    """PEFT ``target_modules``: every linear layer of the blocks for the default (all) targets, else the names."""
    if set(cfg.lora.targets) == set(LORA_TARGETS):
        return "all-linear"
    return [LORA_OUR_TO_HF.get(t, t) for t in cfg.lora.targets]


def _with_lora(model: Any, cfg: TorchaxModelConfig, task: str) -> Any:
    import peft
    import torch

    lcfg = peft.LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                           target_modules=lora_targets(cfg), task_type=task)
    try:
        return peft.get_peft_model(model, lcfg)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"model.lora.targets={cfg.lora.targets}: {e}. This model's linear modules: {names}") from None


def _layer_stack(module: Any) -> list[Any]:
    """The transformer blocks: the longest ModuleList whose children share one class."""
    import torch

    best: list[Any] = []
    for m in module.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best


@dataclass(frozen=True)
class ModelInfo:
    """What the loop needs to know about a torchax model (the native families' config offers the same)."""

    family: str  # transformers model_type
    vocab_size: int
    max_seq_len: int
    n_layer: int
    d_model: int
    n_head: int
    n_params: int  # unique parameters (tied ones once), adapters included
    n_embed: int  # embedding parameters
    needs_key: bool  # dropout somewhere: the step passes a key
    compute_dtype: str = "float32"
    remat: str = "none"

    def num_params(self, non_embedding: bool = False) -> int:
        return self.n_params - (self.n_embed if non_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """6 (non-embedding params + head) + 12 L d T attention (the native families' convention)."""
        return 6 * (self.num_params(True) + self.vocab_size * self.d_model) + 12 * self.n_layer * self.d_model * seq_len


class TorchaxModel:
    """A HF causal LM (optionally PEFT-wrapped) as pure functions of JAX arrays.

    Parameters are nested dicts of arrays keyed by the module path (`nest` of ``named_parameters``):
    ``trainable`` (all of them, or only LoRA's A/B with PEFT) and ``frozen`` (the base with LoRA, else empty).
    """

    def __init__(self, module: Any, *, remat: str = "none", compute_dtype: str = "float32"):
        self.torchax = import_torchax()
        self.env = self.torchax.default_env()
        self.module = module
        if remat not in REMAT_POLICIES:
            raise ConfigError(f"model.remat={remat!r}; choose one of {sorted(REMAT_POLICIES)}")
        self.remat = remat
        self.compute_dtype = jnp.dtype(compute_dtype)
        params = dict(module.named_parameters())  # tied weights appear once
        total = sum(p.numel() for p in params.values())
        out_emb, in_emb = module.get_output_embeddings(), module.get_input_embeddings()
        if getattr(module.config, "tie_word_embeddings", False) and out_emb is not None and (
                out_emb.weight is not in_emb.weight):
            raise RuntimeError(f"{type(module).__name__}: the config ties the output embedding to the input one, "
                               "but the module holds two tensors; training would untie them")
        self.trainable_names = [n for n, p in params.items() if p.requires_grad]
        self.frozen_names = [n for n, p in params.items() if not p.requires_grad]
        self.buffers = {n: jnp.asarray(to_numpy(b)) for n, b in module.named_buffers()}
        hf = self.hf_config
        dropout = any(getattr(hf, k, 0) or 0 for k in ("attention_dropout", "hidden_dropout", "resid_pdrop",
                                                        "embd_pdrop", "attn_pdrop", "dropout"))
        lora_dropout = any(getattr(m, "p", 0) for n, m in module.named_modules() if n.endswith("lora_dropout.default"))
        embed = module.get_input_embeddings().weight.numel()
        self.info = ModelInfo(
            family=hf.model_type, vocab_size=module.get_input_embeddings().num_embeddings,
            max_seq_len=getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", 0),
            n_layer=len(_layer_stack(module)), d_model=getattr(hf, "hidden_size", None) or hf.n_embd,
            n_head=getattr(hf, "num_attention_heads", None) or hf.n_head,
            n_params=total, n_embed=embed, needs_key=bool(dropout or lora_dropout), compute_dtype=compute_dtype,
            remat=remat)
        self._layers = _layer_stack(module)
        self._wrapped = False

    @property
    def hf_config(self) -> Any:
        return self.module.config

    @property
    def base(self) -> Any:
        """The transformers model (under PEFT's wrapper with LoRA)."""
        return self.module.get_base_model() if self.frozen_names else self.module

    def initial(self, param_dtype: str = "float32") -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(trainable, frozen) host arrays of the module's current weights, nested. LoRA's adapters stay float32;
        ``param_dtype`` applies to the rest."""
        params = dict(self.module.named_parameters())
        lora = bool(self.frozen_names)
        train_dtype = "float32" if lora else param_dtype
        trainable = {n: to_numpy(params[n], train_dtype) for n in self.trainable_names}
        frozen = {n: to_numpy(params[n], param_dtype) for n in self.frozen_names}
        return nest(trainable), nest(frozen)

    # --- the function ---

    def logits(self, weights: dict[str, Any], tokens: jax.Array, positions: jax.Array | None = None,
               key: jax.Array | None = None) -> jax.Array:
        """weights: the nested trainable and frozen params merged (`merge_weights`); tokens (B, T) int32,
        positions (B, T) (restarting at 0 for each packed row; None: 0..T-1) -> (B, T, V) float32 logits."""
        return self._call(weights, tokens, positions, key).astype(jnp.float32)

    def hidden(self, weights: dict[str, Any], tokens: jax.Array, positions: jax.Array | None = None,
               key: jax.Array | None = None) -> jax.Array:
        """(B, T, D): what the output layer reads (the final normalised hidden states), in the compute dtype."""
        return self._call(weights, tokens, positions, key, caught="hidden")

    def scores(self, weights: dict[str, Any], tokens: jax.Array, positions: jax.Array | None = None,
               key: jax.Array | None = None) -> jax.Array:
        """A sequence classifier's (a reward model's) score head at every position: (B, T) float32, caught as the
        ``score`` module's output, before transformers pools it at the last token that is not padding."""
        return self._call(weights, tokens, positions, key, caught="scores")[..., 0].astype(jnp.float32)

    def _call(self, weights: dict[str, Any], tokens: jax.Array, positions: jax.Array | None, key: jax.Array | None,
              caught: str | None = None) -> jax.Array:
        """The module's logits, or what a hook catches: the input its output embedding received (``hidden``), the
        output of a classifier's ``score`` module (``scores``)."""
        import torch
        from torchax import interop

        self._wrap_layers()
        # Mixed precision: weights (float32 master copies, or a bfloat16 LoRA base) enter the forward in the
        # compute dtype; their gradients flow back through the cast in float32. (torchax's autocast mode is not
        # used: its cast policy breaks on ops with list arguments, e.g. the cat inside torch.diff.)
        cd = self.compute_dtype
        flat = {**self.buffers, **{n: jnp.asarray(w, cd if jnp.issubdtype(w.dtype, jnp.floating) else None)
                                   for n, w in flatten(weights).items()}}
        kwargs = {"input_ids": jnp.asarray(tokens), "use_cache": False}
        if positions is not None:
            kwargs["position_ids"] = jnp.asarray(positions)
        tflat, tkwargs = interop.torch_view((flat, kwargs))
        prop = {"prng": key} if key is not None else {}
        seen: list[Any] = []
        hook = None
        if caught == "hidden":
            hook = self.module.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        elif caught == "scores":
            hook = self.base.score.register_forward_hook(lambda m, args, out: seen.append(out))
        try:
            with self.env, self.env.override_property(**prop), _naming_failures(self.module):
                out = torch.func.functional_call(self.module, tflat, args=(), kwargs=tkwargs, tie_weights=True,
                                                 strict=False)
        finally:
            if hook is not None:
                hook.remove()
        return interop.jax_view(seen[0] if caught else out.logits)

    def _wrap_layers(self) -> None:
        """Remat (``model.remat``): each transformer block's forward runs under `jax.checkpoint` with the policy,
        so the backward pass recomputes the block instead of keeping its activations."""
        if self._wrapped or self.remat == "none":
            return
        for layer in self._layers:
            layer.forward = _checkpointed(layer.forward, self.env, REMAT_POLICIES[self.remat])
        self._wrapped = True


def merge_weights(params: dict[str, Any], frozen: tuple) -> dict[str, Any]:
    """The trainable params and the frozen group (a LoRA base) as one nested dict of the model's weights."""
    if not frozen:
        return params
    return nest({**flatten(frozen[0]), **flatten(params)})


def _checkpointed(forward: Callable, env: Any, policy: Any) -> Callable:
    """``forward`` (a torch block's) under jax.checkpoint: tensors in and out cross as JAX arrays, everything else
    is static. The block's own weights (torchax tensors of the outer trace) are closed over; JAX lifts them as
    inputs of the checkpoint, so their gradients flow. Dropout draws from a key passed in, never from the
    environment's key inside (that would leak a tracer out of the checkpoint)."""
    import torch
    from torch.utils import _pytree as torch_pytree
    from torchax import interop

    def wrapped(*args, **kwargs):
        leaves, spec = torch_pytree.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        key = env.get_and_rotate_prng_key()

        def pure(arrays, key):
            # the block's hidden states (its first tensor) are what model.remat=offload keeps in host memory; not its
            # mask or rotary tables, which every block shares
            arrays = [checkpoint_name(arrays[0], LAYER_INPUT), *arrays[1:]]
            vals = list(leaves)
            for i, a in zip(where, interop.torch_view(arrays)):
                vals[i] = a
            a, kw = torch_pytree.tree_unflatten(vals, spec)
            with env.override_property(prng=key):
                return interop.jax_view(forward(*a, **kw))

        out = jax.checkpoint(pure, policy=policy)(interop.jax_view([leaves[i] for i in where]), key)
        return interop.torch_view(out)

    return wrapped


@contextlib.contextmanager
def _naming_failures(module: Any) -> Iterator[None]:
    """Turn torchax's OperatorNotFound into an `UnsupportedOpError` naming the op and the innermost module that
    was running (module forward hooks keep a stack of qualified names while the model is traced)."""
    import torch
    from torchax.tensor import OperatorNotFound

    names = {m: n for n, m in module.named_modules()}
    stack: list[str] = []
    pre = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: stack.append(f"{names.get(m, '?')} ({type(m).__name__})"))
    post = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: stack.pop() and None)
    try:
        yield
    except OperatorNotFound as e:
        where = stack[-1] if stack else "the model's forward"
        op = str(e).removeprefix("Operator with name ").removesuffix(" has no lowering")
        raise UnsupportedOpError(
            f"torchax has no JAX lowering for {op}, used in {where}. Register one with "
            "torchax's env.override_op_definition, or use a model without this op") from None
    except Exception as e:  # a lowering that exists but fails: say where, keep the original error
        if stack:
            e.add_note(f"(raised while torchax ran {stack[-1]})")
        raise
    finally:
        pre.remove()
        post.remove()


def fsdp_axes(shape: tuple[int, ...], fsdp: int) -> tuple[str | None, ...]:
    """The shape rule: shard a parameter's largest dimension that ``fsdp`` divides over the fsdp axis
    (replicate vectors and parameters with no such dimension)."""
    if fsdp <= 1 or len(shape) < 2:
        return (None,) * len(shape)
    dims = sorted((d for d in range(len(shape)) if shape[d] % fsdp == 0), key=lambda d: -shape[d])
    return tuple("fsdp" if dims and d == dims[0] else None for d in range(len(shape)))

