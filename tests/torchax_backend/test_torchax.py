"""model.backend=torchax: a HuggingFace PyTorch causal LM run through JAX (torchax). Tiny models, CPU.

Error measure: rel(ours, ref) = max|ours - ref| / max|ref| over the whole tensor (per parameter for gradients).
Tolerances (float32):
  * torchax vs PyTorch eager, loss and every gradient (packed batch):  rel <= 1e-5
  * 20 AdamW steps, torchax vs the native model, same HF init:         rel <= 1e-4 per step (and eval loss)
  * Gemma 3, packed rows vs each segment alone (summed loss, grads):   rel <= 1e-5, token counts equal
  * padded / packed batches: loss and all gradients finite
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compare import rel
from helpers.tiny_hf import save_chatml_tokenizer

from jaxtune.config import TorchaxModelConfig, load_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# Not importorskip: a plain `import torchax` fails under torch 2.13 (see compat). A spec without an origin is this
# test directory itself (tests/ is on sys.path), seen as a namespace package when torchax is not installed.
_spec = importlib.util.find_spec("torchax")
if _spec is None or _spec.origin is None:
    pytest.skip("torchax is not installed", allow_module_level=True)

from jaxtune.backends.torchax import compat
from jaxtune.backends.torchax.model import (
    TorchaxModel,
    UnsupportedOpError,
    _naming_failures,
    build_torch_model,
    flatten,
)
from jaxtune.train.logprobs import token_logps
from jaxtune.train.objectives import CrossEntropy
from jaxtune.train.step import objective_loss


def _configs(vocab: int, **extra) -> dict:
    """Tiny transformers configs (2 layers, width 32, no dropout) of the four families."""
    common = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
              "bos_token_id": 0, "eos_token_id": 0, **extra}
    return {
        "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=vocab,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                bos_token_id=0, eos_token_id=0),
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=8),
        # sliding window 8 < the segments' lengths, so the window changes what a query sees
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, head_dim=8, sliding_window=8,
                                                        query_pre_attn_scalar=8,
                                                        layer_types=["sliding_attention", "full_attention"]),
    }


def _perturb(module, seed: int, noise: float = 0.05) -> None:
    """Every tensor moved off its init (norm weights are constants otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))


def _hf_config_dir(tmp_path: Path, family: str, vocab: int) -> Path:
    d = tmp_path / f"{family}-config"
    _configs(vocab)[family]().save_pretrained(d)
    return d


def test_hidden_states_are_what_the_output_layer_reads(tmp_path):
    """`TorchaxModel.hidden` is the input of the module's output embedding: for Llama, logits == hidden @ W.T
    (rel <= 1e-5), shape (B, T, D)."""
    model = TorchaxModel(build_torch_model(TorchaxModelConfig(hf_config=str(_hf_config_dir(tmp_path, "llama", V1))),
                                           seed=0))
    weights = model.initial()[0]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V1, (2, 12)), jnp.int32)
    hidden, logits = np.asarray(model.hidden(weights, tokens)), np.asarray(model.logits(weights, tokens))
    head = model.module.get_output_embeddings().weight.detach().numpy()
    assert hidden.shape == (2, 12, head.shape[1])
    ref = hidden @ head.T
    assert np.abs(logits - ref).max() <= 1e-5 * np.abs(ref).max()


def test_token_entropy_is_the_logits(tmp_path):
    """`TorchaxForward.token_logps_and_entropy`: its log-probs are `token_logps`' and its entropies those of
    softmax(logits / temperature) written out in numpy (rel <= 1e-5)."""
    from jaxtune.backends.torchax.backend import TorchaxForward

    model = TorchaxModel(build_torch_model(TorchaxModelConfig(hf_config=str(_hf_config_dir(tmp_path, "llama", V1))),
                                           seed=0))
    weights = model.initial()[0]
    tokens = np.random.default_rng(0).integers(0, V1, (2, 13)).astype(np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    forward = TorchaxForward(model)
    logps, entropy = forward.token_logps_and_entropy(weights, batch, None, 0.7)
    assert np.array_equal(np.asarray(logps), np.asarray(forward.token_logps(weights, batch, None, 0.7)))
    z = np.asarray(model.logits(weights, batch["inputs"]), np.float64) / 0.7
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert rel(np.asarray(entropy), -(p * np.log(p)).sum(-1)) <= 1e-5


# --- 1. loss and gradients equal PyTorch eager ---------------------------------------------------------------------

V1, B1, T1 = 96, 2, 24
SEGMENTS = [(11, 13), (16, 8)]  # two packed segments per row, positions restarting at 0


def _packed_batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V1, (B1, T1 + 1)).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in row]) for row in SEGMENTS]).astype(np.int32)
    seg = np.stack([np.concatenate([np.full(n, i + 1) for i, n in enumerate(row)]) for row in SEGMENTS])
    mask = (rng.random((B1, T1)) < 0.7).astype(np.float32)
    mask[:, -1] = 1.0
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": pos, "loss_mask": mask,
            "segment_ids": seg.astype(np.int32)}


def _eager_loss(module, batch: dict, positions: bool = True):
    """Summed masked cross-entropy of the PyTorch model itself (position_ids, no attention_mask: transformers
    derives the packed causal mask from the restarting positions, as it does under torchax)."""
    kwargs = {"position_ids": torch.from_numpy(batch["positions"]).long()} if positions else {}
    out = module(input_ids=torch.from_numpy(batch["inputs"]).long(), use_cache=False, **kwargs)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                           torch.from_numpy(batch["targets"]).long().reshape(-1), reduction="none")
    return (ce * torch.from_numpy(batch["loss_mask"]).reshape(-1)).sum()


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma3"])
def test_loss_and_grads_equal_pytorch_eager(family, tmp_path):
    """One packed batch (two segments per row, loss mask with zeros): the torchax loss and the gradient of every
    parameter (jax.value_and_grad under jit) equal PyTorch autograd's on the same module (rel <= 1e-5)."""
    module = build_torch_model(TorchaxModelConfig(hf_config=str(_hf_config_dir(tmp_path, family, V1))),
                               seed=0)
    _perturb(module, seed=1)
    model = TorchaxModel(module)
    params, frozen = model.initial()
    assert frozen == {} and model.info.family == module.config.model_type and model.info.vocab_size == V1
    batch = _packed_batch()

    def loss_fn(p, b):
        logits = model.logits(p, b["inputs"], b["positions"])
        assert logits.shape == (B1, T1, V1) and logits.dtype == jnp.float32
        return -jnp.sum(token_logps(logits, b["targets"]) * b["loss_mask"])

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, {k: jnp.asarray(v) for k, v in batch.items()})

    module.zero_grad()
    ref = _eager_loss(module, batch)
    ref.backward()
    ref_grads = {n: p.grad.numpy() for n, p in module.named_parameters()}
    grads = flatten(jax.device_get(grads))
    assert sorted(grads) == sorted(ref_grads)
    errs = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}
    loss_err = rel(float(loss), ref.item())
    worst = max(errs, key=errs.get)
    print(f"{family}: loss rel {loss_err:.2e}, worst grad rel {errs[worst]:.2e} ({worst})")
    assert loss_err <= 1e-5, (float(loss), ref.item())
    assert errs[worst] <= 1e-5, (worst, errs[worst])
    assert all(np.abs(g).max() > 0 for g in ref_grads.values())  # every parameter is exercised
    # The batch really is packed: with positions 0..T-1 (one sequence per row) the loss differs by far more than
    # the tolerance (measured: rel 9e-4 for Llama, more for the others).
    with torch.no_grad():
        unpacked = rel(_eager_loss(module, batch, positions=False).item(), ref.item())
        print(f"{family}: unpacked vs packed rel {unpacked:.2e}")
        assert unpacked > 1e-4


# --- 2. training: torchax vs native from the same HF checkpoint ----------------------------------------------------

HF_VOCAB = 320  # the checkpoints' vocabulary; the BPE below has 300 ids
WORDS = ["red", "green", "blue", "cat", "dog", "fish", "one", "two", "three", "sun", "moon", "star", "tree", "river",
         "stone", "bird"]
STEPS = 20


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> dict:
    """48 short conversations (train.jsonl) and their texts, for a BPE tokenizer saved beside each checkpoint."""
    root = tmp_path_factory.mktemp("torchax-chat")
    rng = random.Random(0)
    rows = []
    for _ in range(48):
        a, b = rng.choice(WORDS), rng.choice(WORDS)
        rows.append({"messages": [{"role": "user", "content": f"say {a} then {b}"},
                                  {"role": "assistant", "content": f"{a} {b} {a}."}]})
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "train": path, "texts": [m["content"] for r in rows for m in r["messages"]]}


def _run(directory: Path, chat: dict, run_dir: Path, backend: str):
    from jaxtune.loop import train

    cfg = load_config(None, [
        f"model.from_hf={directory}", f"model.backend={backend}", "data.format=messages",
        f"data.sources=[{chat['train']}]", "data.seq_len=64", "data.val_fraction=0.1", f"train.steps={STEPS}",
        "train.batch_size=2", "optim.name=adamw", "optim.lr=1e-2", "optim.warmup_steps=2", "eval.batches=1",
        "checkpoint.every=100", "logging.every=1", "logging.progress=false", "logging.tensorboard=false",
        f"run_dir={run_dir}"])
    return train(cfg)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma3"])
def test_training_matches_native(family, chat, tmp_path):
    """A tiny random HF checkpoint fine-tuned for 20 AdamW steps on packed chat rows (mostly two conversations per
    64-token row, then padding; the native model separates them by segment ids, torchax by the restarting
    positions), once by each backend: the per-step train losses and the eval losses (steps 0 and 20) agree
    (rel <= 1e-4), and the loss fell. (GPT-2 drifts most, ~2e-5 by step 15: its step-0 gradients agree to 5e-7, and
    AdamW's first, sign-like updates amplify that float noise; the others stay ~2e-7.)"""
    d = tmp_path / "hf"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_configs(HF_VOCAB, pad_token_id=0)[family]()).eval()
    _perturb(hf, seed=2)
    hf.save_pretrained(d, safe_serialization=True)
    assert save_chatml_tokenizer(d, chat["texts"]) <= HF_VOCAB

    native = _run(d, chat, tmp_path / "native", "native")
    ours = _run(d, chat, tmp_path / "torchax", "torchax")
    assert sorted(native.losses) == sorted(ours.losses) == list(range(1, STEPS + 1))
    a = np.array([ours.losses[s] for s in range(1, STEPS + 1)])
    b = np.array([native.losses[s] for s in range(1, STEPS + 1)])
    errs = np.abs(a - b) / np.abs(b)
    eval_errs = [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(ours.evals, native.evals)]
    print(f"{family}: max step-loss rel {errs.max():.2e} (step {errs.argmax() + 1}), eval rel {max(eval_errs):.2e}")
    assert errs.max() <= 1e-4, list(zip(a, b))
    assert [e["step"] for e in ours.evals] == [e["step"] for e in native.evals] == [0, STEPS]
    assert max(eval_errs) <= 1e-4, (ours.evals, native.evals)
    assert b[-1] < b[0] - 1.0  # it trained: the comparison covers a moving model
    assert ours.step_compiles == len(ours.step_lengths)


# --- 3. padding and packing on Gemma 3 (sliding window) -------------------------------------------------------------

V3, T3 = 96, 24
LENS = [9, 10, 12]  # segment lengths; the packed batch: [9 + 10 + 5 pad], [12 + 12 pad], [24 pad]


def _row(segments: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """One (T3,) row of the given (inputs, targets, mask) segments, then padding (segment 0, positions 0, mask 0)."""
    out = {k: np.zeros(T3, np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    out["loss_mask"] = np.zeros(T3, np.float32)
    at = 0
    for i, (x, y, m) in enumerate(segments):
        n = len(x)
        out["inputs"][at:at + n], out["targets"][at:at + n], out["loss_mask"][at:at + n] = x, y, m
        out["positions"][at:at + n] = np.arange(n)
        out["segment_ids"][at:at + n] = i + 1
        at += n
    return out


def _stack(rows: list[dict]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


@pytest.fixture(scope="module")
def gemma3_spec(tmp_path_factory):
    """The Gemma 3 TorchaxSpec (random init through model.hf_config), its jitted loss-and-grad, and noisy params."""
    from jaxtune.backends import make_state_spec
    from jaxtune.sharding import make_mesh

    d = _hf_config_dir(tmp_path_factory.mktemp("gemma3"), "gemma3", V3)
    cfg = load_config(None, ["model.backend=torchax", f"model.hf_config={d}"])
    spec = make_state_spec(cfg, V3, make_mesh(1, 1, 1, jax.devices()[:1]))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(a + 0.05 * rng.standard_normal(a.shape), a.dtype), spec.host_params)
    loss_fn = objective_loss(CrossEntropy(), spec.forward(), spec.weights)

    def loss_and_count(p, b):
        total, (count, _) = loss_fn(p, b, None, ())
        return total, count

    fn = jax.jit(jax.value_and_grad(loss_and_count, has_aux=True))
    return spec, params, fn


def _finite(loss, grads) -> bool:
    return bool(np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads)))


def test_packed_and_padded_batches_are_finite_and_packing_is_exact(gemma3_spec):
    """Gemma 3 (sliding window 8, full attention in the other layer): a packed batch whose rows end in padding
    (one row all padding) and the same segments each alone in a right-padded row give finite losses and
    gradients; the packed summed loss equals the sum of the segments' losses alone (rel <= 1e-5), with equal token
    counts and gradients (rel <= 1e-5 per parameter). Padded rows without positions (plain causal mask over the
    padding) are finite too."""
    spec, params, fn = gemma3_spec
    assert spec.model.info.family == "gemma3_text" and spec.model.hf_config.sliding_window == 8
    rng = np.random.default_rng(1)
    segs = []
    for n in LENS:
        mask = (rng.random(n) < 0.7).astype(np.float32)
        mask[-1] = 1.0
        segs.append((rng.integers(0, V3, n), rng.integers(0, V3, n), mask))
    packed = _stack([_row(segs[:2]), _row(segs[2:]), _row([])])
    alone = _stack([_row([s]) for s in segs])

    (loss_p, n_p), g_p = fn(params, packed)
    (loss_a, n_a), g_a = fn(params, alone)
    assert _finite(loss_p, g_p) and _finite(loss_a, g_a)
    assert float(n_p) == float(n_a) == sum(float(m.sum()) for _, _, m in segs)
    loss_err = rel(float(loss_p), float(loss_a))
    grad_err = max(jax.tree.leaves(jax.tree.map(rel, g_p, g_a)))
    print(f"gemma3 packed vs alone: loss rel {loss_err:.2e}, worst grad rel {grad_err:.2e}")
    assert loss_err <= 1e-5, (float(loss_p), float(loss_a))
    assert grad_err <= 1e-5, grad_err
    # The check can fail: without positions the packed row's second segment attends to the first.
    no_pos = {k: v for k, v in packed.items() if k != "positions"}
    (loss_leaky, _), g_leaky = fn(params, no_pos)
    assert _finite(loss_leaky, g_leaky)
    print(f"gemma3 leaky rel {rel(float(loss_leaky), float(loss_a)):.2e}")
    assert rel(float(loss_leaky), float(loss_a)) > 1e-4

    # Unpacked, right-padded rows with no positions at all (padding attends causally to the row).
    (loss_u, n_u), g_u = fn(params, {k: v for k, v in alone.items() if k != "positions"})
    assert _finite(loss_u, g_u) and float(n_u) == float(n_a)
    assert rel(float(loss_u), float(loss_a)) <= 1e-5  # padding after a row never changes it (causal)
    # A batch with no trained token: loss 0, gradients 0 (no NaN from masked rows).
    (loss_0, n_0), g_0 = fn(params, {**packed, "loss_mask": jnp.zeros_like(packed["loss_mask"])})
    assert float(loss_0) == 0.0 and float(n_0) == 0.0 and _finite(loss_0, g_0)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_0))


# --- 4. the compat layer ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,named", [
    ("dim_Dimname", True), ("dimname", True), ("Dimname_Scalar", True), ("names_dim", True),
    ("correction_names", True), ("names_ScalarOpt_dim_dtype", True), ("dimname_out", True),
    ("default", False), ("dim_int", False), ("Tensor", False), ("out", False), ("correction", False),
    ("dim_IntList", False), ("Scalar_out", False),
])
def test_is_named_tensor_overload(name, named):
    assert compat._is_named_tensor_overload(name) is named


def test_tolerate_removed_overloads(monkeypatch):
    """Inside the context a missing named-tensor overload is an inert placeholder (recorded in PATCHED), any other
    missing overload still raises AttributeError, existing overloads resolve as before; afterwards the original
    lookup is back and the missing overload raises again."""
    monkeypatch.setattr(compat, "PATCHED", [])
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__
    prod = torch.ops.aten.prod
    assert not hasattr(prod, "dim_Dimname")  # torch 2.13 removed it: the reason for the shim
    with compat._tolerate_removed_overloads():
        assert packet.__getattr__ is not original
        placeholder = prod.dim_Dimname
        assert isinstance(placeholder, compat.MissingOverload)
        assert placeholder.name == "aten.prod.dim_Dimname"
        assert isinstance(torch.ops.aten.std.names_dim, compat.MissingOverload)
        assert compat.PATCHED == ["aten.prod.dim_Dimname", "aten.std.names_dim"]
        with pytest.raises(AttributeError):
            _ = prod.no_such_overload
        with pytest.raises(AttributeError):
            _ = prod.dim_int_with_typo
        assert isinstance(prod.dim_int, torch._ops.OpOverload)
        with pytest.raises(RuntimeError, match="aten.prod.dim_Dimname does not exist"):
            placeholder(torch.ones(2))
        assert placeholder != compat.MissingOverload("aten.prod.dim_Dimname")  # equal only to itself
        assert {placeholder: 1}[placeholder] == 1  # hashable: the op tables are dicts keyed by overload
    assert packet.__getattr__ is original
    assert not hasattr(prod, "dim_Dimname")  # nothing was cached on the packet
    assert compat.PATCHED == ["aten.prod.dim_Dimname", "aten.std.names_dim"]


def test_tolerate_removed_overloads_restores_on_error():
    original = torch._ops.OpOverloadPacket.__getattr__
    with pytest.raises(KeyError), compat._tolerate_removed_overloads():
        raise KeyError("boom")
    assert torch._ops.OpOverloadPacket.__getattr__ is original


def test_import_torchax():
    """import_torchax() returns torchax (the same module every call) with a working default environment: a torch
    op on viewed JAX arrays computes in JAX."""
    tx = compat.import_torchax()
    assert tx.__name__ == "torchax" and compat.import_torchax() is tx
    from torchax import interop

    env = tx.default_env()
    x = interop.torch_view(jnp.arange(6, dtype=jnp.float32).reshape(2, 3))
    with env:
        y = torch.nn.functional.softmax(x * 2 + 1, dim=-1).sum(0)
    out = interop.jax_view(y)
    assert isinstance(out, jax.Array)
    ref = torch.softmax(torch.arange(6.0).reshape(2, 3) * 2 + 1, dim=-1).sum(0).numpy()
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6)


# --- 5. an op torchax cannot lower is named, with the module that used it ---------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.act = torch.nn.Tanh()

    def forward(self, x):
        return torch.special.airy_ai(self.act(x))  # aten::special_airy_ai: no torchax lowering (0.0.13)


class _Outer(torch.nn.Module):
    """No parameters: the input is the only (torchax) tensor."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(4, elementwise_affine=False)
        self.block = _Block()

    def forward(self, x):
        return self.block(self.norm(x)).sum()


@pytest.mark.parametrize("jit", [False, True])
def test_unsupported_op_names_op_and_module(jit):
    """An aten op torchax has no lowering for, called by the child `block` (after its own child `act` ran): the
    error is an UnsupportedOpError naming the op and `block`, not `act`; the global module hooks are removed after."""
    from torchax import interop
    from torchax.tensor import OperatorNotFound

    tx = compat.import_torchax()
    env = tx.default_env()
    module = _Outer()
    hooks = module_hooks()

    def run(arr):
        with env, _naming_failures(module):
            return interop.jax_view(module(interop.torch_view(arr)))

    x = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(UnsupportedOpError) as e:
        jax.jit(run)(x) if jit else run(x)
    msg = str(e.value)
    assert "aten::special_airy_ai" in msg and "block (_Block)" in msg and "Tanh" not in msg, msg
    assert isinstance(e.value, NotImplementedError)
    assert module_hooks() == hooks
    # Without the context the same failure is torchax's own error.
    with pytest.raises(OperatorNotFound), env:
        module(interop.torch_view(x))


def module_hooks() -> tuple[int, int]:
    m = torch.nn.modules.module
    return len(m._global_forward_pre_hooks), len(m._global_forward_hooks)


# --- parameter trees and sharding rule -------------------------------------------------------------------------------

def test_nest_flatten_merge_and_fsdp_axes():
    """nest/flatten are inverse on dotted module paths; merge_weights overlays trainable params on the frozen base
    (and passes params through without one); fsdp_axes shards the largest dimension fsdp divides."""
    from jaxtune.backends.torchax.model import fsdp_axes, merge_weights, nest

    flat = {"model.layers.0.q.weight": 1, "model.layers.0.q.lora_A": 2, "model.layers.1.q.weight": 3, "lm_head": 4}
    tree = nest(flat)
    assert tree == {"model": {"layers": {"0": {"q": {"weight": 1, "lora_A": 2}}, "1": {"q": {"weight": 3}}}},
                    "lm_head": 4}
    assert flatten(tree) == flat
    params = nest({"model.layers.0.q.lora_A": 20})
    frozen = nest({"model.layers.0.q.weight": 1, "model.layers.0.q.lora_A": 2, "lm_head": 4})
    assert flatten(merge_weights(params, (frozen,))) == {"model.layers.0.q.weight": 1, "model.layers.0.q.lora_A": 20,
                                                        "lm_head": 4}
    assert merge_weights(params, ()) is params
    assert fsdp_axes((8, 6), 2) == ("fsdp", None)
    assert fsdp_axes((6, 8), 2) == (None, "fsdp")
    assert fsdp_axes((6, 8), 4) == (None, "fsdp")
    assert fsdp_axes((8, 6), 3) == (None, "fsdp")  # 8 is not divisible by 3: the largest divisible dimension
    assert fsdp_axes((5, 7), 2) == (None, None)
    assert fsdp_axes((8, 8), 2) == ("fsdp", None)  # a tie: the first
    assert fsdp_axes((8,), 2) == (None,)  # vectors replicate
    assert fsdp_axes((8, 6), 1) == (None, None)
