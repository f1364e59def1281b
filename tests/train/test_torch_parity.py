"""Training parity with PyTorch: the same GPT-2 init and batches, AdamW + warmup/cosine + clipping + decay on
matrices only, in jaxtune's jitted step and in a plain PyTorch loop (transformers' GPT2LMHeadModel,
torch.optim.AdamW): the losses of 10 steps agree to 1e-4 relative (fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.sharding import make_mesh
from jaxtune.train.objectives import CrossEntropy
from jaxtune.train.step import make_train_step, objective_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, T, B, STEPS = 512, 32, 4, 10


def test_adamw_training_matches_pytorch(hf_gpt2_to_params):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=T, vocab_size=V, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, bos_token_id=0,
        eos_token_id=0)).float()
    cfg = load_config(None, ["model.preset=tiny", "model.n_layer=2", "model.n_head=4", "model.d_model=64",
                             f"model.max_seq_len={T}", "optim.name=adamw", "optim.lr=3e-3", "optim.b2=0.95",
                             "optim.weight_decay=0.1", "optim.grad_clip=1.0", "optim.warmup_steps=3",
                             "optim.schedule=cosine", f"train.steps={STEPS}"])
    spec = make_state_spec(cfg, V, make_mesh(1, 1, 1, jax.devices()[:1]))
    params = hf_gpt2_to_params(hf, 2)
    state = spec.init(0)._replace(params=params, opt_state=spec.tx.init(params))
    loss = objective_loss(CrossEntropy(), spec.forward(), spec.weights)
    step = jax.jit(make_train_step(loss, spec.tx, spec.lr_schedule, use_dropout=False))

    rng = np.random.RandomState(0)
    pair = [rng.randint(0, V, (B, T + 1)).astype(np.int64) for _ in range(2)]
    batches = pair * (STEPS // 2)  # two batches seen repeatedly: learnable, so the loss must fall

    decay = [p for p in hf.parameters() if p.ndim >= 2]
    no_decay = [p for p in hf.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8)
    # The schedule's values themselves are tested in test_step.py; here both sides use the same numbers.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(spec.lr_schedule(s)) / cfg.optim.lr)

    ours, theirs = [], []
    for toks in batches:
        state, m = step(state, {"inputs": jnp.asarray(toks[:, :-1], jnp.int32),
                                "targets": jnp.asarray(toks[:, 1:], jnp.int32)})
        ours.append(float(m["loss"]))

        logits = hf(torch.from_numpy(toks[:, :-1])).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.from_numpy(toks[:, 1:]).reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        sched.step()
        theirs.append(loss.item())

    rel = np.abs(np.array(ours) - np.array(theirs)) / np.abs(np.array(theirs))
    assert rel.max() <= 1e-4, list(zip(ours, theirs))
    assert ours[-1] < ours[0] - 0.3  # and it actually trained
