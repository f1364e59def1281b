"""Optimizer and learning-rate schedule from the `optim` config section."""

from __future__ import annotations

import jax
import optax

from jaxtune.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``lr``, then cosine/linear decay to ``min_lr_ratio * lr`` (or constant)."""
    decay = max((cfg.decay_steps or total_steps) - cfg.warmup_steps, 1)
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


def decay_mask(params):
    """Weight decay on matrices only (kernels, embeddings), not on biases or norm scales (nanoGPT, GPT-3)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    lr = schedule(cfg, total_steps)
    if cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "adafactor":
        # Factored second moments (memory ~ rows + cols per matrix); clipping comes from grad_clip below.
        opt = optax.adafactor(lr, clipping_threshold=None, multiply_by_parameter_scale=False,
                              weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=decay_mask)
    else:
        opt = optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
                          optax.sgd(lr, momentum=cfg.momentum or None))
    if cfg.grad_clip:
        opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)
    return opt
