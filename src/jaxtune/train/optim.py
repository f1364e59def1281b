"""Optimizer and learning-rate schedule from the `optim` config section.

``optim.formulation`` 1 passes the section's numbers (the learning rate and its schedule's steps, the betas, epsilon,
weight decay, momentum, the clipping norm) to the train program as inputs (`Optimizer.inputs`), so that a run with
another lr or number of steps reuses a compiled program (from JAX's persistent compilation cache) instead of
compiling one with its constants folded in. Formulation 0 folds them in, as runs saved before the key did: XLA
rewrites the folded schedule's arithmetic, so the two round a few steps' learning rates one ulp apart, and a run
saved before resumes with 0 to continue bitwise. What shapes the optimizer's state or program stays a constant:
the optimizer's name, the schedule's kind, whether there is clipping (and, for Adafactor and SGD, weight decay or
momentum at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtune.config import OptimConfig

Hyper = Mapping[str, Any]  # the section's numbers, Python floats or the program's float32 scalars


def decay_steps(cfg: OptimConfig, total_steps: int) -> int:
    """Updates from the end of the warm-up to the end of the decay (at least 1)."""
    return max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)


def hyperparameters(cfg: OptimConfig, total_steps: int) -> dict[str, float]:
    """The numbers formulation 1 passes to the train program (`make_optimizer`, `schedule` read them)."""
    return {"lr": cfg.lr, "warmup": float(cfg.warmup_steps), "decay": float(decay_steps(cfg, total_steps)),
            "min_lr_ratio": cfg.min_lr_ratio, "b1": cfg.b1, "b2": cfg.b2, "eps": cfg.eps,
            "weight_decay": cfg.weight_decay, "momentum": cfg.momentum, "grad_clip": cfg.grad_clip or 0.0}


def schedule(cfg: OptimConfig, total_steps: int, hyper: Hyper | None = None) -> optax.Schedule:
    """Linear warmup from ``lr / warmup_steps`` to ``lr``, then cosine/linear decay to ``min_lr_ratio * lr`` (or
    constant). ``hyper``: read the numbers from it (formulation 1), else from ``cfg`` as constants."""
    if hyper is not None:
        return _schedule_of(cfg.schedule, hyper)
    decay = decay_steps(cfg, total_steps)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(cfg.lr, end, decay)
    else:
        main = optax.constant_schedule(cfg.lr)
    if not cfg.warmup_steps:
        return main
    warm = optax.linear_schedule(cfg.lr / cfg.warmup_steps, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, main], [cfg.warmup_steps])


def _schedule_of(kind: str, h: Hyper) -> optax.Schedule:
    """`schedule`'s formulas (optax's) on numbers that may be the program's inputs: no warm-up when it is 0."""
    lr, warmup, decay, ratio = (jnp.asarray(h[k], jnp.float32) for k in ("lr", "warmup", "decay", "min_lr_ratio"))

    def at(count):
        count = jnp.asarray(count, jnp.float32)
        done = jnp.clip(count - warmup, 0.0, decay) / decay  # the share of the decay done
        if kind == "cosine":
            main = lr * ((1.0 - ratio) * 0.5 * (1.0 + jnp.cos(jnp.pi * done)) + ratio)
        elif kind == "linear":
            main = (lr - lr * ratio) * (1.0 - done) + lr * ratio
        else:
            main = lr
        steps = jnp.maximum(warmup, 1.0)
        start = lr / steps
        warm = (start - lr) * (1.0 - jnp.clip(count, 0.0, steps) / steps) + lr
        return jnp.where(count < warmup, warm, main)

    return at


def decay_mask(params):
    """Weight decay on matrices only (kernels, embeddings), not on biases or norm scales (nanoGPT, GPT-3)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, total_steps: int, hyper: Hyper | None = None) -> optax.GradientTransformation:
    """The optimizer of ``cfg``; ``hyper``: its numbers read from there (formulation 1), else ``cfg``'s constants.
    Either way the same state (`Optimizer`)."""
    h = hyperparameters(cfg, total_steps) if hyper is None else hyper
    lr = schedule(cfg, total_steps, hyper)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=h["b1"], b2=h["b2"], eps=h["eps"], weight_decay=h["weight_decay"], mask=decay_mask)
    elif cfg.name == "adafactor":
        # Factored second moments (memory ~ rows + cols per matrix); clipping comes from grad_clip below.
        opt = optax.adafactor(lr, clipping_threshold=None, multiply_by_parameter_scale=False,
                              weight_decay_rate=h["weight_decay"] if cfg.weight_decay else None,
                              weight_decay_mask=decay_mask)
    else:
        opt = optax.chain(optax.add_decayed_weights(h["weight_decay"], mask=decay_mask),
                          optax.sgd(lr, momentum=h["momentum"] if cfg.momentum else None))
    if cfg.grad_clip:
        opt = optax.chain(optax.clip_by_global_norm(h["grad_clip"]), opt)
    return opt


@dataclass(frozen=True)
class Optimizer:
    """The run's optimizer (``optim`` over ``total_steps`` updates): `tx` and `schedule` with the numbers as
    constants, or read from `inputs` as the train program's arguments (``optim.formulation`` 1)."""

    cfg: OptimConfig
    total_steps: int

    @property
    def inputs(self) -> dict[str, np.ndarray] | None:
        """The train program's optimizer arguments (float32 scalars), or None where they are constants."""
        if self.cfg.formulation == 0:
            return None
        return {k: np.float32(v) for k, v in hyperparameters(self.cfg, self.total_steps).items()}

    def tx(self, hyper: Hyper | None = None) -> optax.GradientTransformation:
        return make_optimizer(self.cfg, self.total_steps, hyper)

    def schedule(self, hyper: Hyper | None = None) -> optax.Schedule:
        return schedule(self.cfg, self.total_steps, hyper)
