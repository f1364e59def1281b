"""What the comparisons with TRL's code share (test_preference_objectives.py, test_grpo_objective.py): a tiny random
fp32 `LlamaForCausalLM` saved with ``save_pretrained`` and perturbed copies of it, a word-level tokenizer for TRL's
trainers, the gradients compared (by `helpers.compare.rel`), and jaxtune's side: a spec read from those checkpoints
(``model.from_hf``) on a one-device mesh, an objective's loss and gradients formed as the train step forms them.

Both modules import what they use by name (``from helpers.trl_reference import MESH, ...``) and make
`one_torch_thread` their autouse fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from helpers.compare import rel
from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import Config, ObjectiveConfig, load_config
from jaxtune.train.reference import Frozen, FrozenCopy, step_reference
from jaxtune.train.step import objective_loss

torch = pytest.importorskip("torch", reason="the TRL comparisons run PyTorch")
transformers = pytest.importorskip("transformers", reason="the tiny checkpoints are transformers models")

TRL_VERSION = "1.16.0"  # the code the formulas, metric names and the comparisons were read from
TOL = 1e-5  # against TRL: losses, metrics and gradients
PAD, BOS, EOS = 0, 1, 2
# jaxtune param path -> (HF tensor, whether ours is its transpose: our kernels are (in, out), nn.Linear's (out, in)).
GRAD_PARAMS = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False),
    ("layers", 0, "attn", "q", "kernel"): ("model.layers.0.self_attn.q_proj.weight", True),
    ("layers", 1, "mlp", "down", "kernel"): ("model.layers.1.mlp.down_proj.weight", True),
    ("norm", "scale"): ("model.norm.weight", False),
    ("lm_head", "embedding"): ("lm_head.weight", False),
}
MESH = sharding.make_mesh(1, 1, 1, jax.devices()[:1])
# XLA's CPU compiles dominate these tests: without LLVM's optimisations, the same operations in a third of the time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# ---------------------------------------------------------------------------------------------------- checkpoints


def one_torch_thread():
    """One PyTorch thread while a module runs, as its autouse fixture: on models this small more threads only
    contend (each eager forward and backward is ~40x slower with 2 on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_checkpoints(root: Path, vocab: int, noise: dict[str, float]) -> dict[str, Path]:
    """{"ref": a random tiny Llama (seed 0), then each name of ``noise`` in order: the one before plus that scale of
    normal noise}, each a save_pretrained directory under ``root``."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.1, bos_token_id=BOS,
                                      eos_token_id=EOS, pad_token_id=PAD)
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(root / "ref")
    for name, scale in noise.items():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn_like(p))
        model.save_pretrained(root / name)
    return {name: root / name for name in ("ref", *noise)}


def hf_model(directory):
    return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------- TRL side


def word_tokenizer(vocab: int):
    """A word-level tokenizer (w3 .. w{vocab - 1}) for TRL's trainers, which need one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def hf_grads(model) -> dict[str, np.ndarray]:
    """The GRAD_PARAMS gradients ``backward`` left on ``model``, by HF name."""
    params = dict(model.named_parameters())
    return {name: params[name].grad.detach().numpy().copy() for name, _ in GRAD_PARAMS.values()}


@dataclass
class TRLResult:
    loss: float
    metrics: dict[str, float]
    grads: dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------------- jaxtune side


def tiny_spec(model_dir, *overrides: str) -> tuple[Config, Any]:
    """(config, spec) of the run ``overrides`` describe from ``model_dir`` (``model.from_hf``) on MESH."""
    cfg = load_config(None, [f"model.from_hf={model_dir}", *overrides])
    return cfg, make_state_spec(cfg, None, MESH)


@dataclass
class Native:
    """The native spec of the checkpoints' architecture, full fine-tuning, and its weights."""

    spec: Any
    policy: Any  # the perturbed checkpoint's params
    ref: Any  # the unperturbed checkpoint's params
    compiled: dict = field(default_factory=dict)  # objective -> jitted value_and_grad of its loss

    @classmethod
    def of(cls, checkpoints: dict[str, Path], *overrides: str) -> Native:
        """The spec of ``overrides`` from the "policy" checkpoint, its params and the "ref" checkpoint's."""
        _, spec = tiny_spec(checkpoints["policy"], *overrides)
        _, ref_spec = tiny_spec(checkpoints["ref"], *overrides)
        return cls(spec, spec.init(0).params, ref_spec.init(0).params)


@dataclass
class Ours:
    loss: float
    count: float
    metrics: dict[str, float]
    grads: Any


def objective_result(native: Native, objective, cfg: ObjectiveConfig, params, batch,
                     means: Callable[[dict, jax.Array], dict[str, float]], carry: dict | None = None) -> Ours:
    """``objective`` (made from ``cfg``) on ``params`` and ``batch`` as the train step forms it: `objective_loss`'s
    sums and their gradients divided by the objective's count, the metric sums by ``means(metrics, count)``. A
    reference is the unperturbed checkpoint, as the frozen copy (`Frozen.companion`); ``carry``: the objective's
    carried scalars, as the step adds them to the batch. `objective_loss`'s value_and_grad is jitted once per
    objective."""
    reference = step_reference(native.spec, cfg)
    assert reference is None or isinstance(reference, FrozenCopy)  # full fine-tuning: a frozen copy of the weights
    if objective not in native.compiled:
        loss_fn = objective_loss(objective, native.spec.forward(), native.spec.weights, reference)
        native.compiled[objective] = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), compiler_options=FAST_COMPILE)
    with sharding.use_mesh(MESH):
        (total, (count, metrics)), grads = native.compiled[objective](
            params, {**sharding.global_batch(MESH, batch), **(carry or {})}, None,
            Frozen((), None if reference is None else native.ref))
    n = float(count)
    return Ours(float(total) / n, n, means(metrics, count), jax.tree.map(lambda g: np.asarray(g) / n, grads))


def our_grad(grads, path) -> np.ndarray:
    """Our gradient at ``path`` laid out as GRAD_PARAMS's HF tensor."""
    node = grads
    for k in path:
        node = node[k]
    return node.T if GRAD_PARAMS[path][1] else node


def assert_close(mine: Ours, theirs, names, metric_error: Callable[[str, dict, dict], float],
                 grads: bool = True) -> dict[str, float]:
    """Loss, the ``names`` metrics (``metric_error(name, ours, theirs)``) and, with ``grads``, the GRAD_PARAMS
    gradients within TOL; the errors."""
    errors = {"loss": rel(mine.loss, theirs.loss)}
    errors |= {k: metric_error(k, mine.metrics, theirs.metrics) for k in names}
    if grads:
        errors |= {name: rel(our_grad(mine.grads, path), theirs.grads[name]) for path, (name, _) in GRAD_PARAMS.items()}
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, (bad, mine.loss, theirs.loss, mine.metrics, theirs.metrics)
    return errors

