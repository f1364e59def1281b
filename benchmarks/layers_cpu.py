"""One layer's attention and one SwiGLU MLP, forward and backward, in each ``model.formulation`` beside PyTorch eager.

Formulation 0 is jaxtune's layout before 2026-11-29 (attention's products with the positions before the heads,
autodiff's dense gradients); 1 has `jaxtune.models.layers._attend` and `layers.matmul`; 2 (the default) differs from 1
in the MLP's down projection, whose weight gradient transposes the narrower output gradient. At SmolLM2-135M's
shapes by default: 4 rows of 260 positions (a reward-model step's shared-prompt rows), 9 query heads over 3 key/value
heads of 64, the rows' mask a prompt then two branches; the MLP 576 -> 1536 -> 576 over the same 1,040 tokens.
PyTorch: ``scaled_dot_product_attention`` with the same boolean mask (``enable_gqa``) and the MLP's three matmuls,
both eager, with as many threads as XLA gets. Each timed call is the value and the gradients of sum(out * w);
medians (and minima) of ``--calls`` calls after two warm-up calls. The formulations' results are printed beside
(their largest difference, relative to the largest entry).

    JAX_PLATFORMS=cpu OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/layers_cpu.py [--calls 40] [--json F]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxtune.models import layers


def timed(fn, calls: int) -> tuple[float, float]:
    fn()
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times)), 1e3 * min(times)


def attention_rows(a, rng) -> dict:
    b, t, n, kh, hd = a.rows, a.positions, a.heads, a.kv_heads, a.head_dim
    q, k, v, w = (rng.standard_normal(s).astype(np.float32) for s in [(b, t, n, hd), (b, t, kh, hd), (b, t, kh, hd),
                                                                       (b, t, n, hd)])
    branches = np.repeat(np.array([0, 1, 2]), [t // 2, t // 4, t - t // 2 - t // 4])[None].repeat(b, 0)
    mask = layers.attention_mask(layers.MaskSpec(t, t, segment_ids=jnp.ones((b, t), jnp.int32),
                                                 branch_ids=jnp.asarray(branches),
                                                 positions=jnp.broadcast_to(jnp.arange(t), (b, t))))
    out = {}
    for f in (0, 1):
        grad = jax.jit(jax.value_and_grad(
            lambda q, k, v, f=f: jnp.sum(layers.attention(q, k, v, mask, None, formulation=f) * w), argnums=(0, 1, 2)))
        out[f"jaxtune, formulation {f}"] = (lambda g=grad: jax.block_until_ready(g(q, k, v)), grad(q, k, v))
    tq, tk, tv = (torch.tensor(x.transpose(0, 2, 1, 3)).requires_grad_() for x in (q, k, v))
    tm, tw = torch.tensor(np.asarray(mask)), torch.tensor(w.transpose(0, 2, 1, 3))

    def torch_step():
        y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, enable_gqa=True)
        (y * tw).sum().backward()

    out["PyTorch eager (sdpa)"] = (torch_step, None)
    return out


def mlp_rows(a, rng) -> dict:
    d, f = a.d_model, a.d_ff
    x, w = (rng.standard_normal((a.rows, a.positions, d)).astype(np.float32) for _ in range(2))
    weights = [(0.02 * rng.standard_normal(s)).astype(np.float32) for s in [(d, f), (d, f), (f, d)]]
    out = {}
    for form in (0, 1, 2):  # 2 differs from 1 in the down projection's weight gradient (1536 -> 576)
        mm = functools.partial(layers.matmul, formulation=form) if form else jnp.matmul

        def loss(ws, x, mm=mm):
            return jnp.sum(mm(jax.nn.silu(mm(x, ws[0])) * mm(x, ws[1]), ws[2]) * w)

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        out[f"jaxtune, formulation {form}"] = (lambda g=grad: jax.block_until_ready(g(weights, x)), grad(weights, x))
    tx = torch.tensor(x, requires_grad=True)
    tg, tu, td = (torch.tensor(m, requires_grad=True) for m in weights)
    tw = torch.tensor(w)

    def torch_step():
        ((torch.nn.functional.silu(tx @ tg) * (tx @ tu)) @ td * tw).sum().backward()

    out["PyTorch eager"] = (torch_step, None)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    h.add_common_args(ap, rows=4, positions=260, heads=9, kv_heads=3, head_dim=64, d_model=576, d_ff=1536)
    ap.add_argument("--calls", type=int, default=40)
    a = ap.parse_args(argv)
    threads = h.pin_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"machine: {h.machine()}; threads {threads}; jax {jax.__version__}, torch {torch.__version__}")
    table = {}
    for name, rows in (("attention", attention_rows(a, rng)), ("SwiGLU MLP", mlp_rows(a, rng))):
        ours = [rows[k][1] for k in rows if k.startswith("jaxtune")]
        new, old = ours[-1], ours[0]  # the newest formulation against 0
        worst = max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / np.abs(np.asarray(y)).max())
                    for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True))
        print(f"\n{name}: formulations agree to {worst:.1e} of the largest entry\n")
        print("| implementation | ms (median) | min |\n| --- | ---: | ---: |")
        for label, (fn, _) in rows.items():
            median, best = timed(fn, a.calls)
            table[f"{name}: {label}"] = {"ms_median": median, "ms_min": best, "formulations_agree": worst}
            print(f"| {label} | {median:.1f} | {best:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": h.machine(), "args": vars(a), "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
